"""The loss scale's story: GradScaler's calibration, its probing, and whether the scale
collapsed (``ScaleStory``, from the steps table alone). Read by the diagnosis (``Facts.story``)
and by the release summary.

Example::

    story = scale_story(run.steps, run.scaler, bad_loss)
    story.calib_len, story.benign, story.collapsed
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..runfile.meta import ScalerInfo
from .thresholds import LOW_SCALE

# GradScaler's calibration: it starts above what the net needs and halves on each overflow, so
# a run of consecutive skipped steps with a finite loss at the very start is normal (taxonomy
# C0). From 2**16 (PyTorch) or 2**32 (apex/DeepSpeed FP16_Optimizer) down to 1 is at most 32
# halvings; a calibration that has to go below a scale of 1 has found no working scale at all
# (pytorch#99640: "there is likely no valid scale for which fp16 works").
MIN_CALIBRATED_SCALE = 1.0
# After calibration GradScaler probes upward once per growth_interval and backs off once:
# about one skip per interval in a steady state (taxonomy C0: ~0.05 %). Early in training the
# gradients still grow and each growth costs a skip and a halving (apex#864, DeepSpeed#931:
# "step=510, skipped=8" is normal). We allow two skips whatever the length plus one per 100
# steps, none of them back to back beyond a pair, all with a finite loss; what the halvings
# cost shows up as a low scale, which grad_underflow judges.
PROBE_SKIPS_FREE = 2
PROBE_SKIP_RATE = 1 / 100
PROBE_MAX_RUN = 2


def runs_of(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start indices and lengths of the runs of True in ``mask``."""
    m = np.concatenate([[False], np.asarray(mask, bool), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    starts, ends = edges[::2], edges[1::2]
    return starts, ends - starts


# ---------------------------------------------------------------------------------------------
# The loss scale


@dataclass
class ScaleStory:
    """What GradScaler did: calibration, probing, and what was not normal.

    Indices are positions in ``run.steps`` (not step numbers).
    """

    has_scaler: bool
    calib_len: int = 0  # consecutive skips at the start
    calib_benign: bool = True
    calib_level: float = math.nan  # the scale once the initial skips ended (NaN: never ended)
    calibrated_scale: float = math.nan  # scale once calibration ended
    post_skips: int = 0  # skips after calibration
    allowed_post: int = 0
    longest_post_run: int = 0
    benign_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    bad_skip: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    terminal_run: int = 0  # skips in a row up to the last step
    min_scale: float = math.nan
    final_scale: float = math.nan
    init_scale: float = math.nan
    growth_interval: int = 2000
    halvings: int = 0  # post-calibration halvings not recovered by growth (log2 fall)
    grew: bool = False  # the scale grew at some step (a clean growth interval passed)

    @property
    def benign(self) -> bool:
        return not bool(self.bad_skip.any())

    @property
    def collapsed(self) -> bool:
        """The scale kept falling: skipping to the end of the run, 8 or more halvings below its
        calibrated level down to a scale that cannot lift small gradients, or a calibration
        that found no scale >= 1."""
        low = min(self.min_scale, self.final_scale)
        return self.has_scaler and (self.terminal_run >= 3 or (
            self.halvings >= 8 and low <= LOW_SCALE) or (
            self.calib_len >= 3 and not self.calib_level >= MIN_CALIBRATED_SCALE))


def scale_story(steps: np.ndarray, scaler: Optional[ScalerInfo],
                loss_bad: np.ndarray) -> ScaleStory:
    """Read GradScaler's history from /steps (``loss_bad``: per step, the loss was non-finite)."""
    n = len(steps)
    # as stored (float32): every value taken below widens to float64 exactly, and a month-long
    # run's scales are not copied
    scale = steps["scale"]
    finite = np.isfinite(scale)
    has = bool(n) and bool(np.any(finite))
    story = ScaleStory(has_scaler=has, benign_mask=np.zeros(n, bool), bad_skip=np.zeros(n, bool))
    if not has:
        return story
    skipped = steps["skipped"] == 1
    after = steps["scale_after"]
    first, last = int(np.argmax(finite)), n - 1 - int(np.argmax(finite[::-1]))
    info = scaler or ScalerInfo()
    story.init_scale = float(info.init_scale or scale[first])
    story.growth_interval = int(info.growth_interval or 2000)
    story.min_scale = float(np.min(scale, where=finite, initial=np.inf))
    with np.errstate(invalid="ignore"):
        story.grew = bool(np.any(after > scale))
    story.final_scale = float(after[-1]) if np.isfinite(after[-1]) else float(scale[last])
    _calibration(story, skipped, scale, after, loss_bad)
    _probing(story, skipped, loss_bad)
    starts, lengths = runs_of(skipped)
    if len(starts) and starts[-1] + lengths[-1] == n:
        story.terminal_run = int(lengths[-1])
    story.halvings = _halvings(story, scale[story.calib_len:])
    return story


def _calibration(story: ScaleStory, skipped: np.ndarray, scale: np.ndarray, after: np.ndarray,
                 loss_bad: np.ndarray) -> None:
    """Skips from the first step on, with a finite loss, ending in an applied step at a scale
    GradScaler can work with (>= 1): benign."""
    n = len(skipped)
    starts, lengths = runs_of(skipped)
    calib = int(lengths[0]) if len(starts) and starts[0] == 0 else 0
    story.calib_len = calib
    if calib:
        ended = calib < n
        level = float(after[calib - 1]) if ended and np.isfinite(after[calib - 1]) else math.nan
        story.calib_level = level
        story.calib_benign = bool(ended and not loss_bad[:calib].any()
                                  and level >= MIN_CALIBRATED_SCALE)
        story.benign_mask[:calib] = story.calib_benign
        story.bad_skip[:calib] = not story.calib_benign
    story.calibrated_scale = float(scale[calib]) if calib < n and np.isfinite(scale[calib]) \
        else story.min_scale


def _probing(story: ScaleStory, skipped: np.ndarray, loss_bad: np.ndarray) -> None:
    """Skips after calibration are probing while few, short and with a finite loss."""
    n, calib = len(skipped), story.calib_len
    post = skipped.copy()
    post[:calib] = False
    story.post_skips = int(post.sum())
    story.allowed_post = PROBE_SKIPS_FREE + int(math.ceil(max(0, n - calib) * max(
        PROBE_SKIP_RATE, 1.0 / max(story.growth_interval, 1))))
    _, lengths = runs_of(post)
    story.longest_post_run = int(lengths.max()) if len(lengths) else 0
    probing = story.post_skips <= story.allowed_post and story.longest_post_run <= PROBE_MAX_RUN
    story.benign_mask |= post & probing & ~loss_bad
    story.bad_skip |= post & ~story.benign_mask


def _halvings(story: ScaleStory, tail: np.ndarray) -> int:
    """How far (in halvings) the scale fell below its calibrated level; 200 if it reached 0."""
    tail = tail[np.isfinite(tail)]
    low = float(min(tail.min(), story.final_scale)) if len(tail) else story.calibrated_scale
    if not np.isfinite(story.calibrated_scale) or story.calibrated_scale <= 0 or low <= 0:
        return 200 if story.min_scale <= 0 or low <= 0 else 0
    return max(0, int(round(math.log2(story.calibrated_scale / low))))
