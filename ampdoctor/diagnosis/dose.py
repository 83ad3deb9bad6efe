"""The numbers a fix prescribes, measured from the run in front of us: the learning rate, the
initial loss scale, Adam's eps and the clipping threshold, each with the clause that says
where it comes from (``fixes.Dose``).

numpy only. ``Doses(f)`` measures on first use and keeps what it measured; the fixes ask it by
name through ``fixes.Context.dose`` (``Facts.fix_context`` hands it over):

* ``lr``: tried, where the recorder ran its LR range test at the first non-finite loss
  (``lrrange.py``: the rung below the highest whose trial loss fell and stayed in the run's
  healthy range, "tried: LR X kept the loss at Y over N steps"). Else a bound, said as such
  with why there was no trial ("a bound, not a trial (...)"), measured as follows.
  An update ratio |dW|/|W| around ``TARGET_RATIO`` per step is healthy, and a step's
  ratio grows with the LR (Adam's in proportion to it, SGD's with it and the gradient), so at
  a sampled step with ratio r and LR L the LR is about L * TARGET_RATIO / r (when only the
  first step was sampled, against that step's own healthy size: ``FIRST_ADAM`` for Adam's
  sign-sized first update, TARGET_RATIO * (1 - momentum) for SGD's): the median over
  the sampled steps up to where the run stopped being steady (after it the ratios describe a
  broken run: dead units stop moving, NaN), the first step left out when others exist (every
  optimizer's first update is unlike its later ones). It is capped by the largest LR at
  which the run was still steady (the LR history before the gradient norm, the loss or the
  update ratio first jumped, ``JUMP``), and always set below the LR where it jumped. With no
  sampled ratio, an order of magnitude below that LR. A ratio at ``RATIO_CEILING`` bounds the
  LR and measures no value: then the highest LR at which a sampled step was still healthy
  (``STABLE_RATIO``), where the run has one, else an order of magnitude below the bound, and
  the source says which. ``lr_factor`` is the new LR over the
  run's peak: the whole schedule scaled (``record --apply lr_factor=F``); in a run treated
  with ``lr_factor=G`` already, G times that: against the user's own command.
* ``init_scale``: the power of two that lifts the smallest layer's recorded gradient rms
  (unscaled: divided by the step's loss scale) into fp16's normal range (>= 2**-14) without
  passing 65504 with the largest recorded gradient: the middle of that band of exponents.
* ``eps`` (fp16 optimizer state): where fp16 flushes Adam's second moment to 0 the update is
  lr * m / eps, so an eps of the order of the smallest layer's gradient rms (the power of ten
  at or below it) keeps those updates near the LR; at least fp16's smallest subnormal, and
  enough that m / eps stays below 65504 for the largest recorded gradient.
* ``max_norm``: the script's own ``clip_grad_norm_`` max_norm where it clips (/meta
  ``clip``; accelerate's split ``clip_grads_with_norm_`` too); else the ``CLIP_PERCENTILE``
  th percentile of the gradient norm over the steady steps (before the failure or the first
  jump).

Where the run holds too little, a dose is None and the fix falls back to ``fixes.DEFAULTS``
(or, for the LR, a tenth of the peak), whose source says which default and why.

Example::

    doses = Doses(Facts(ampdoctor.load("run.h5")))
    doses("lr")   # Dose(values={'lr': 0.0057, 'lr_factor': 0.029}, source='update ratio ...')
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..numfmt import fmt
from ..runfile import schema
from ..runfile.meta import AppliedFix, OptimizerInfo
from ..runfile.schema import Kind, Source
from . import lrrange
from .fixes import Dose

# The optimizers whose first step is sign-sized (facts.ADAM_FAMILY's Adams, repeated here:
# facts imports this module).
ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "FusedAdam", "AdamW8bit", "Adam8bit",
               "PagedAdamW", "DeepSpeedCPUAdam")

# ``f`` below is a ``facts.Facts`` (typed Any: facts.py imports this module, and an import
# back, even for types only, would be a cycle among diagnosis' modules).
Facts = Any

# taxonomy §1 / §3: Adam's healthy update ratio |dW|/|W| is ~1e-3 per step.
TARGET_RATIO = 1e-3
# ... but Adam's first step is sign-sized (|m / sqrt(v)| = 1 for every element), ~lr/|w|: at a
# sane LR 1e-2 and up (overflow.REPLACED's comment). When the first step is the only sample,
# it is measured against this. (SGD's first step is 1 - momentum of its later ones.)
FIRST_ADAM = 1e-2
# A gradient norm, loss or update ratio 10x the median of the steps before it: the run stopped
# being steady there (overflow.py's growth thresholds are 10x too).
JUMP = 10.0
# The steps before a jump that its median is taken over, and how many it needs.
JUMP_WINDOW = 20
JUMP_MIN = 3
# The update ratios are kept up to 10 (streamed.py clips their log there): a ratio at that
# ceiling is "at least 10".
RATIO_CEILING = 10.0
# An update ratio at most this is a healthy step (10x TARGET_RATIO: what a bounded LR falls
# back on, the highest LR at which a sampled step was still healthy).
STABLE_RATIO = 1e-2
# max_norm: this percentile of the steady steps' gradient norms, from this many steps.
CLIP_PERCENTILE = 90
CLIP_MIN_STEPS = 5
# The clips whose max_norm bounds the gradient's total norm: torch's, and the split API of
# torch >= 2.6 that accelerate >= 1.16 calls (get_total_norm, then clip_grads_with_norm_)
NORM_CLIPS = ("clip_grad_norm_", "clip_grads_with_norm_")
# The largest initial loss scale prescribed (GradScaler grows it further by itself).
MAX_SCALE_EXP = 24


@dataclass(frozen=True)
class Jump:
    """Where the run stopped being steady: ``seen``, the step position where it showed
    (``what``: "the loss jumped"), and ``update``, the position of the optimizer step whose
    update caused it (a loss, a gradient norm or a non-finite forward shows the update of the
    step before; an update ratio is its own step's)."""

    seen: int
    update: int
    what: str


def _round(x: float) -> float:
    """Two significant digits: a number a person types (0.0057, 1.4e-05)."""
    return float(f"{x:.2g}")


class Doses:
    """The doses of one run, measured on first use (``doses(name)``; None: not measurable)."""

    def __init__(self, f: Facts):
        self.f = f
        self._done: dict[str, Optional[Dose]] = {}

    def __call__(self, name: str) -> Optional[Dose]:
        if name not in self._done:
            measure = {"lr": self.lr, "init_scale": self.init_scale, "eps": self.eps,
                       "max_norm": self.max_norm}.get(name)
            self._done[name] = measure() if measure is not None else None
        return self._done[name]

    # -- the learning rate ----------------------------------------------------------------

    def lr(self) -> Optional[Dose]:
        f = self.f
        lr = f.steps["lr"].astype(float) if f.n else np.zeros(0)
        known = np.isfinite(lr) & (lr > 0)
        if not known.any():
            return None
        peak = float(lr[known].max())
        trial = lrrange.tried(f)
        if trial.lr is not None:
            return self._against_command(_round(trial.lr), peak, trial.source)
        value, source = self._bounded_lr(lr, known, peak)
        if trial.failed_at is not None and value >= trial.failed_at:
            value = _round(trial.failed_at / 10)
            source = (f"a decade below LR {fmt(trial.failed_at)}, the lowest the LR range test "
                      f"tried, where no rung trained ({source[0].lower() + source[1:]}, was "
                      "higher)")
        return self._against_command(value, peak, f"a bound, not a trial ({trial.why}): "
                                     f"{source}")

    def _against_command(self, value: float, peak: float, source: str) -> Dose:
        """The LR dose, its ``lr_factor`` against the user's own command: a run treated with
        ``--apply lr_factor=F`` recorded its LRs times F, so the next factor is F times the
        new LR over the recorded peak; one treated with ``lr=X`` gets ``lr`` alone."""
        treated = applied_lr(self.f)
        if treated is None:
            return Dose({"lr": value, "lr_factor": _round(value / peak)}, source)
        form, given = treated
        if form != "lr_factor":
            return Dose({"lr": value}, f"{source}; this run ran with --apply {form}={given:g}, "
                        "so the LR is given as it is, not as a factor")
        factor = _round(given * value / peak)
        return Dose({"lr": value, "lr_factor": factor},
                    f"{source}; lr_factor {fmt(factor)} is against your own command (this run "
                    f"ran with --apply lr_factor={given:g}: its LRs were yours times {given:g})")

    def _bounded_lr(self, lr: np.ndarray, known: np.ndarray, peak: float) -> tuple[float, str]:
        """The LR from the update ratios and the LR history (no trial): a bound."""
        f = self.f
        jump = self.jump()
        limit = float(lr[jump.update]) if jump is not None and known[jump.update] else peak
        where = (f"LR {fmt(limit)}, the LR of the update before {jump.what} at step "
                 f"{f.step_at(jump.seen)}" if jump is not None else f"the peak LR {fmt(peak)}")
        measured = self._ratio_lr()
        if measured is not None:
            value, source, bounded = measured
            if bounded:  # the ratio sat at the ceiling: the run bounds the LR, measures no value
                value, source = self._below_bound(value, source)
        else:
            value = limit / 10
            source = f"an order of magnitude below {where} (no sampled update ratio to " \
                     "measure the step size)" if jump is not None else \
                f"a tenth of {where}: the default, no sampled update ratio to measure the step"
        steady = lr[:jump.update][known[:jump.update]] if jump is not None else np.zeros(0)
        if len(steady) and float(steady.max()) < limit * 0.999 and value > steady.max():
            value = float(steady.max())
            source += f", capped at LR {fmt(value)}, the largest at which the run was steady"
        if value >= limit * 0.999:
            value = limit / 10
            source += f"; set an order of magnitude below {where}"
        return _round(value), source

    def _below_bound(self, bound: float, source: str) -> tuple[float, str]:
        """An update ratio at ``RATIO_CEILING`` says only that the LR must be below ``bound``.
        The highest LR at which a sampled step's ratio was still healthy (at most
        ``STABLE_RATIO``) is a value the run measured, where it has one; else an order of
        magnitude below the bound, said as such."""
        f = self.f
        jump = self.jump()
        end = jump.seen + 1 if jump is not None else f.n
        upd, lr = f.reduced.upd_log[:end], f.steps["lr"].astype(float)[:end]
        ok = f.reduced.sampled[:end] & np.isfinite(upd) & np.isfinite(lr) & (lr > 0)
        stable = ok & (upd <= math.log10(STABLE_RATIO))
        clause = (f"{source}: that is only an upper bound (the ratio reached the recorder's "
                  f"ceiling of {fmt(RATIO_CEILING)})")
        if stable.any():
            value = float(lr[stable].max())
            i = int(np.flatnonzero(stable & (lr == value))[0])
            return value, (f"{clause}; at sampled step {f.step_at(i)} the update ratio was "
                           f"still {fmt(10.0 ** upd[i])} at LR {fmt(value)}, the highest LR at "
                           "which the run measured a healthy step")
        return bound / 10, (f"{clause} and no sampled step measured a healthy one; set an "
                            "order of magnitude below the bound")

    def _ratio_lr(self) -> Optional[tuple[float, str, bool]]:
        """L * TARGET_RATIO / r over the sampled steps before the failure (the first step left
        out when others exist), with its source clause, and whether the ratio was at the
        ceiling (then the value is an upper bound, not a measurement)."""
        f = self.f
        jump = self.jump()  # after it the ratios describe a broken run (dead units, NaN)
        end = jump.seen + 1 if jump is not None else f.n
        upd = f.reduced.upd_log
        lr = f.steps["lr"].astype(float)
        idx = np.flatnonzero(f.reduced.sampled[:end] & ~f.skipped[:end] & np.isfinite(
            upd[:end]) & np.isfinite(lr[:end]) & (lr[:end] > 0))
        if len(idx) > 1 and idx[0] == 0:
            idx = idx[1:]
        if not len(idx):
            return None
        ratio = 10.0 ** upd[idx]
        first = len(idx) == 1 and idx[0] == 0
        target, why = self._first_target() if first else (TARGET_RATIO, "per step")
        value = float(np.median(lr[idx] * target / ratio))
        r, at_lr = float(np.median(ratio)), float(np.median(lr[idx]))
        least = "at least " if r >= RATIO_CEILING * 0.999 else ""
        where = (f"median of {len(idx)} sampled steps" if len(idx) > 1 else
                 f"sampled step {f.step_at(int(idx[0]))}")
        if least:
            return value, (f"update ratio at least {fmt(r)} at LR {fmt(at_lr)} ({where}); at "
                           f"~{target:g} {why} the LR is at most {fmt(_round(value))}"), True
        return value, (f"update ratio {fmt(r)} at LR {fmt(at_lr)} ({where}); at "
                       f"~{target:g} {why} the LR is about {fmt(_round(value))}"), False

    def _first_target(self) -> tuple[float, str]:
        """The healthy ratio of an optimizer's first update, when that is all that was
        sampled: Adam's is sign-sized (``FIRST_ADAM``), SGD's has no momentum yet."""
        opt = self.f.optimizers[0] if self.f.optimizers else OptimizerInfo()
        name = opt.name
        if name in ADAM_FAMILY:
            return FIRST_ADAM, f"for {name}'s first, sign-sized step"
        momentum = opt.momentum or 0.0
        if 0 < momentum < 1:
            return TARGET_RATIO * (1 - momentum), (f"for a first step, before momentum "
                                                   f"{momentum:g} builds it up")
        return TARGET_RATIO, "per step"

    def jump(self) -> Optional[Jump]:
        """The first place the run stopped being steady: the failure, the loss curve's first
        spike, or a gradient norm, loss or update ratio ``JUMP`` x the median before it."""
        return self.f.memo("dose_jump", self._jump)

    def _jump(self) -> Optional[Jump]:
        f = self.f
        if not f.n:
            return None
        seen: list[tuple[int, str]] = []
        if f.failure_index is not None:
            seen.append((f.failure_index, "the failure began"))
        if f.curve.spikes:
            seen.append((f.curve.spikes[0].onset, "the loss jumped"))
        for column, what in (("grad_norm", "the gradient norm jumped"),
                             ("loss", "the loss jumped")):
            i = _first_jump(f.steps[column].astype(float))
            if i is not None:
                seen.append((i, what))
        found = [Jump(i, max(i - 1, 0), what) for i, what in seen]
        upd = f.reduced.upd_log
        sampled = np.flatnonzero(np.isfinite(upd))
        if len(sampled) > 2:
            i = _first_jump(10.0 ** upd[sampled])
            if i is not None:
                found.append(Jump(int(sampled[i]), int(sampled[i]), "the update ratio jumped"))
        return min(found, key=lambda j: (j.update, j.seen)) if found else None

    # -- the loss scale -------------------------------------------------------------------

    def grad_sizes(self) -> Optional[tuple[str, float, float]]:
        """(name of the layer with the smallest gradient rms, that rms, the largest gradient
        abs max), unscaled, over the sampled steps before the failure; None without one."""
        return self.f.memo("grad_sizes", lambda: _grad_sizes(self.f))

    def init_scale(self) -> Optional[Dose]:
        sizes = self.grad_sizes()
        if sizes is None:
            return None
        name, small, big = sizes
        lo = math.ceil(math.log2(schema.FP16_TINY / small))
        hi = math.floor(math.log2(schema.FP16_MAX / big))
        if lo <= hi:
            k = min((lo + hi) // 2, MAX_SCALE_EXP)
            source = (f"{name}'s gradient rms {fmt(small)}, the smallest, needs 2**{lo} to reach "
                      f"fp16's normal range and the largest gradient, {fmt(big)}, overflows "
                      f"above 2**{hi}: 2**{k} lies between")
        else:
            k = min(hi, MAX_SCALE_EXP)
            source = (f"the largest gradient, {fmt(big)}, overflows above 2**{hi}, and "
                      f"{name}'s gradient rms {fmt(small)} needs 2**{lo}: no one scale serves "
                      "both (bf16 does)")
        k = max(k, 0)
        return Dose({"init_scale": float(2 ** k)}, source)

    # -- Adam's eps -----------------------------------------------------------------------

    def eps(self) -> Optional[Dose]:
        if self.state_dtype() != "float16":
            return None
        sizes = self.grad_sizes()
        if sizes is None:
            return None
        name, small, big = sizes
        value = 10.0 ** math.floor(math.log10(small))
        floor = max(schema.FP16_SUBNORMAL_MIN, big / schema.FP16_MAX)
        raised = value < floor
        if raised:
            value = 10.0 ** math.ceil(math.log10(floor))
        source = (f"the order of {name}'s gradient rms {fmt(small)}, the smallest: where fp16 "
                  "flushes Adam's second moment to 0 the update is lr * m / eps, near the LR "
                  "at that eps")
        if raised:
            source += (f"; raised to {fmt(value)} so that m / eps stays below 65504 for the "
                       f"largest gradient {fmt(big)}")
        return Dose({"eps": value}, source)

    def state_dtype(self) -> Optional[str]:
        """The dtype of the optimizer's second moment (exp_avg_sq), else of the weights."""
        for opt in self.f.optimizers:
            if opt.state_dtypes.get("exp_avg_sq"):
                return opt.state_dtypes["exp_avg_sq"]
        d = self.f.param_dtypes
        return max(d, key=lambda k: d[k]) if d else None

    # -- the clipping threshold -----------------------------------------------------------

    def max_norm(self) -> Optional[Dose]:
        f = self.f
        own = (f.run.clip or {})
        value = own.get("max_norm")
        how = own.get("how") or "clip_grad_norm_"
        if how in NORM_CLIPS and isinstance(value, (int, float)) and \
                not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return Dose({"max_norm": float(value)}, f"the script's own clip, "
                        f"{how}(max_norm={float(value):g}), as the run called it")
        if not f.n:
            return None
        jump = self.jump()
        end = jump.seen if jump is not None else f.n
        gn = f.steps["grad_norm"][:end].astype(float)
        ok = np.isfinite(gn) & (gn > 0) & ~f.skipped[:end]
        if ok.sum() < CLIP_MIN_STEPS:
            return None
        value = _round(float(np.percentile(gn[ok], CLIP_PERCENTILE)))
        before = f" before step {f.step_at(end)} ({jump.what})" if jump is not None else ""
        return Dose({"max_norm": value}, f"the {CLIP_PERCENTILE}th percentile of the gradient "
                    f"norm over the {int(ok.sum())} steady steps{before}")


def applied_lr(f: Facts) -> Optional[tuple[str, float]]:
    """("lr_factor" or "lr", its value) of a run treated with ``record --apply`` on its LR,
    or None."""
    applied: list[AppliedFix] = f.run.applied  # (Facts.run is untyped: the records are not)
    for a in applied:
        name, _, value = a.arg.partition("=")
        if name in ("lr_factor", "lr") and not a.error:
            try:
                return name, float(value)
            except ValueError:
                return None
    return None


def _first_jump(x: np.ndarray) -> Optional[int]:
    """The first position whose value is ``JUMP`` x the median of the (up to ``JUMP_WINDOW``)
    finite values before it, given ``JUMP_MIN`` of them; None when there is none."""
    x = np.where(np.isfinite(x) & (x > 0), x, np.nan)
    n = len(x)
    if n <= JUMP_MIN:
        return None
    padded = np.concatenate([np.full(JUMP_WINDOW, np.nan), x])
    windows = np.lib.stride_tricks.sliding_window_view(padded, JUMP_WINDOW)[:n]
    counts = np.sum(np.isfinite(windows), axis=1)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # windows with no finite value
        before = np.nanmedian(windows, axis=1)
        hit = (counts >= JUMP_MIN) & (x >= JUMP * before)
    idx = np.flatnonzero(hit)
    return int(idx[0]) if len(idx) else None


# The /stats columns the gradient sizes read.
_COLUMNS = schema.columns("stats", "step", "tensor", "source", "nonfinite", "rms", "absmax")


def _grad_sizes(f: Facts) -> Optional[tuple[str, float, float]]:
    """One pass over the sampled gradient rows (see ``Doses.grad_sizes``)."""
    kinds, names = f.tensor_kinds, f.tensor_names
    steps = f.step_values
    if not len(kinds) or not f.n:
        return None
    scale = f.steps["scale"].astype(float)
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    end = f.horizon
    log_sum, count = np.zeros(len(kinds)), np.zeros(len(kinds))
    big = 0.0
    for rows in f.run.stats.chunks(f.chunk, names=_COLUMNS):
        tid = rows["tensor"].astype(np.int64)
        keep = (rows["source"] == Source.SAMPLED) & (tid >= 0) & (tid < len(kinds)) & \
            (rows["nonfinite"] == 0) & (rows["step"] < end)
        keep[keep] &= kinds[tid[keep]] == Kind.PARAM_GRAD
        if not keep.any():
            continue
        r, t = rows[keep], tid[keep]
        pos = np.minimum(np.searchsorted(steps, r["step"]), f.n - 1)
        clean = ~f.skipped[pos]
        s = scale[pos]
        rms, absmax = r["rms"].astype(float) / s, r["absmax"].astype(float) / s
        use = clean & np.isfinite(rms) & (rms > 0)
        np.add.at(log_sum, t[use], np.log10(rms[use]))
        np.add.at(count, t[use], 1.0)
        fin = clean & np.isfinite(absmax)
        if fin.any():
            big = max(big, float(absmax[fin].max()))
    measured = np.flatnonzero(count > 0)
    if not len(measured) or big <= 0:
        return None
    means = log_sum[measured] / count[measured]
    smallest = int(measured[np.argmin(means)])
    return names[smallest], float(10 ** means.min()), big
