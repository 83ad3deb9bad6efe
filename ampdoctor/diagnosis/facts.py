"""Views of a loaded run that the diagnosis rules share, each computed once.

numpy only (no torch). ``Facts`` wraps a ``store.Run``: the small tables are read whole, the
big ``/stats`` table is streamed once in chunks (``Stats``), reduced on the fly to arrays per
step and per tensor, so memory stays bounded however long the run. ``ScaleStory`` reads the
GradScaler's history from ``/steps`` and tells normal calibration apart from trouble.

Thresholds live in ``rules.py``; the few here describe GradScaler itself and are commented where
they are defined.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..runfile import schema
from ..runfile.schema import DType, Event, Kind, Phase, Source, flag
from . import curve
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

# A weight whose norm is below this is (close to) zero-initialised: its update ratio says
# nothing about the step size.
TINY_NORM = 1e-6

PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.INPUT: "input",
          Phase.LOSS: "loss", Phase.OPTIMIZER: "optimizer", Phase.NONE: "none",
          Phase.UNKNOWN: "unknown"}

ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "SparseAdam", "Adagrad", "Adadelta",
               "RMSprop", "Adafactor", "LAMB", "Lamb", "FusedAdam", "FusedLAMB", "AdamW8bit",
               "Adam8bit", "PagedAdamW", "DeepSpeedCPUAdam")


def runs_of(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start indices and lengths of the runs of True in ``mask``."""
    m = np.concatenate([[False], np.asarray(mask, bool), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    starts, ends = edges[::2], edges[1::2]
    return starts, ends - starts


def fp16_rounds_to_zero(x: float) -> bool:
    """Does ``x`` become 0.0 when stored in fp16? (round to nearest: |x| <= 2**-25)"""
    return x != 0 and abs(float(np.float16(x))) == 0.0


def module_of(param_name: str) -> str:
    """'blocks.3.attn.qkv.weight' -> 'blocks.3.attn.qkv'; buffers alike."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


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


def scale_story(steps: np.ndarray, scaler: Optional[dict], loss_bad: np.ndarray) -> ScaleStory:
    """Read GradScaler's history from /steps (``loss_bad``: per step, the loss was non-finite)."""
    n = len(steps)
    scale = steps["scale"].astype(np.float64)
    has = bool(n) and bool(np.any(np.isfinite(scale)))
    story = ScaleStory(has_scaler=has, benign_mask=np.zeros(n, bool), bad_skip=np.zeros(n, bool))
    if not has:
        return story
    skipped = steps["skipped"] == 1
    after = steps["scale_after"].astype(np.float64)
    finite_scale = scale[np.isfinite(scale)]
    info = scaler or {}
    story.init_scale = float(info.get("init_scale") or finite_scale[0])
    story.growth_interval = int(info.get("growth_interval") or 2000)
    story.min_scale = float(finite_scale.min())
    story.final_scale = float(after[-1]) if np.isfinite(after[-1]) else float(finite_scale[-1])
    _calibration(story, skipped, scale, after, loss_bad)
    _probing(story, skipped, loss_bad)
    starts, lengths = runs_of(skipped)
    if len(starts) and starts[-1] + lengths[-1] == n:
        story.terminal_run = int(lengths[-1])
    story.halvings = _halvings(story, scale[story.calib_len:])
    return story


def _calibration(story: ScaleStory, skipped, scale, after, loss_bad) -> None:
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


def _probing(story: ScaleStory, skipped, loss_bad) -> None:
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


# ---------------------------------------------------------------------------------------------
# The sampled statistics, streamed once


# Columns read from /stats; nothing else is loaded.
_COLUMNS = ("step", "tensor", "seq", "source", "nonfinite", "numel", "sample_n", "zeros",
            "sub16", "subbf16", "near16", "over16", "absmax", "rms", "norm", "update", "unchanged")


@dataclass
class Stats:
    """Per-step and per-tensor reductions of the sampled tier (source SAMPLED rows only).

    Per step (arrays over ``run.steps`` positions; NaN or 0 where nothing was sampled):
      sampled, out_absmax (largest finite output abs max), out_near (outputs with values
      >= 2**15), out_bad (outputs non-finite), grad_under / grad_n (gradient elements that are
      zero-or-subnormal in the run's low precision, and elements counted), wnorm2 (sum of squared
      weight norms), param_bad (parameters with a non-finite norm), upd_log (mean log10 update
      ratio), unchanged (element-weighted unchanged fraction), buffer_bad, input_bad,
      input_over (input elements beyond fp16 range), input_absmax, grad_zero / grad_numel
      (trained-parameter gradient elements that are exactly 0, weighted by tensor size, and
      the elements weighed: their ratio is the share of the model that got no gradient).
    Per tensor (arrays over tensor ids), before ``horizon`` (the first failing step):
      under_sum / under_cnt (share of a gradient's non-zero elements that are subnormal,
      summed over samples), out_max and
      near_max (largest output abs max and near-overflow fraction), norm_first / norm_last,
      upd_sum / upd_cnt (mean log10 update ratio), unch_sum / unch_cnt; over the whole run:
      first_bad_step (first sampled step with a non-finite value), last_bad (non-finite at the
      tensor's last sample); for module outputs, out_zero_last (exactly 0 everywhere at the
      tensor's last sample: every unit dead for the whole batch), out_alive_step (last sampled
      step with a non-zero value), out_seen_step (last sampled step); for gradients,
      grad_zero_last (share of exact zeros at the tensor's last sample).
    """

    n_steps: int
    n_tensors: int
    rows: int = 0
    first_nonfinite: Optional[dict] = None  # step, module, phase, kind, tensor
    first_forward: Optional[dict] = None  # the same, for module outputs only
    first_backward: Optional[dict] = None  # ... for gradients arriving at module outputs

    def __post_init__(self) -> None:
        n, t = self.n_steps, self.n_tensors
        self.sampled = np.zeros(n, bool)
        self.out_absmax = np.full(n, np.nan)
        self.out_near = np.zeros(n, np.int64)
        self.out_bad = np.zeros(n, np.int64)
        self.grad_under = np.zeros(n)
        self.grad_n = np.zeros(n)
        self.wnorm2 = np.zeros(n)
        self.wcount = np.zeros(n, np.int64)
        self.param_bad = np.zeros(n, np.int64)
        self._upd_sum = np.zeros(n)
        self._upd_cnt = np.zeros(n)
        self._unch_sum = np.zeros(n)
        self._unch_n = np.zeros(n)
        self.buffer_bad = np.zeros(n, np.int64)
        self.input_bad = np.zeros(n, np.int64)
        self.input_over = np.zeros(n, np.int64)
        self.input_absmax = np.full(n, np.nan)
        self.under_sum = np.zeros(t)
        self.under_cnt = np.zeros(t)
        self.zero_sum = np.zeros(t)  # sum of exact-zero fractions of the gradient, per tensor
        self.grms_sum = np.zeros(t)  # sum of log10 gradient rms (scaled space), per tensor
        self.grms_cnt = np.zeros(t)
        self.out_max = np.full(t, np.nan)
        self.near_max = np.zeros(t)
        self.norm_first = np.full(t, np.nan)
        self.norm_first_step = np.full(t, -1, np.int64)
        self.norm_last = np.full(t, np.nan)
        self.upd_sum = np.zeros(t)
        self.upd_cnt = np.zeros(t)
        self.unch_sum = np.zeros(t)
        self.unch_cnt = np.zeros(t)
        self.first_bad_step = np.full(t, -1, np.int64)
        self.last_step = np.full(t, -1, np.int64)
        self.last_bad = np.zeros(t, bool)
        self.grad_zero = np.zeros(n)
        self.grad_numel = np.zeros(n)
        self.out_zero_last = np.zeros(t, bool)
        self.out_alive_step = np.full(t, -1, np.int64)
        self.out_seen_step = np.full(t, -1, np.int64)
        self.grad_zero_last = np.full(t, np.nan)

    @property
    def upd_log(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._upd_cnt > 0, self._upd_sum / np.maximum(self._upd_cnt, 1),
                            np.nan)

    @property
    def unchanged(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._unch_n > 0, self._unch_sum / np.maximum(self._unch_n, 1),
                            np.nan)

    @property
    def grad_zero_share(self) -> np.ndarray:
        """Per step: share of the trained parameters' gradient elements that are exactly 0
        (NaN where no gradient was sampled)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.grad_numel > 0, self.grad_zero / np.maximum(self.grad_numel, 1),
                            np.nan)

    @property
    def layer_under(self) -> np.ndarray:
        """Mean underflow fraction of each tensor's gradient before the horizon (NaN: none)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.under_cnt > 0, self.under_sum / np.maximum(self.under_cnt, 1),
                            np.nan)

    @property
    def layer_zeros(self) -> np.ndarray:
        """Mean exact-zero fraction of each tensor's gradient, where layer_under is measured."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.under_cnt > 0, self.zero_sum / np.maximum(self.under_cnt, 1),
                            np.nan)

    @property
    def layer_grad_rms(self) -> np.ndarray:
        """Geometric mean rms of each tensor's gradient before the horizon (NaN: none)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.grms_cnt > 0, 10 ** (self.grms_sum / np.maximum(
                self.grms_cnt, 1)), np.nan)

    @property
    def layer_unchanged(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.unch_cnt > 0, self.unch_sum / np.maximum(self.unch_cnt, 1),
                            np.nan)

    @property
    def layer_update(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.upd_cnt > 0, self.upd_sum / np.maximum(self.upd_cnt, 1), np.nan)


_PHASE_ORDER = {int(Kind.INPUT): (0, "input"), int(Kind.OUTPUT): (1, "forward"),
                int(Kind.GRAD_OUTPUT): (2, "backward"), int(Kind.PARAM_GRAD): (3, "backward"),
                int(Kind.PARAM): (4, "optimizer"), int(Kind.BUFFER): (5, "buffer")}


def stream_stats(run: Any, kinds: np.ndarray, names: list, step_values: np.ndarray,
                 skipped: np.ndarray, horizon: int, low: str, chunk: int = 1 << 16) -> Stats:
    """One pass over /stats (SAMPLED rows), ``chunk`` rows at a time, vectorised per chunk.

    ``kinds``/``names``: tensor id -> Kind / name. ``step_values``: run.steps["step"] (sorted).
    ``horizon``: step number where the failure starts (pre-failure reductions stop there).
    ``low``: the run's low precision, "fp16" or "bf16" (which subnormal band counts).
    """
    n, t = len(step_values), len(kinds)
    out = Stats(n, t)
    sub_col = "subbf16" if low == "bf16" else "sub16"
    best: Optional[tuple] = None
    best_fwd: Optional[tuple] = None
    best_bwd: Optional[tuple] = None
    for rows in run.stats.chunks(chunk, names=_COLUMNS):
        rows = rows[(rows["source"] == Source.SAMPLED) & (rows["tensor"] >= 0)
                    & (rows["tensor"] < t)]
        if not len(rows):
            continue
        pos = np.searchsorted(step_values, rows["step"])
        ok = (pos < n) & (step_values[np.minimum(pos, n - 1)] == rows["step"]) if n else \
            np.zeros(len(rows), bool)
        rows, pos = rows[ok], pos[ok]
        if not len(rows):
            continue
        out.rows += len(rows)
        tid = rows["tensor"].astype(np.int64)
        kind = kinds[tid]
        bad = rows["nonfinite"] > 0
        pre = rows["step"] < horizon
        clean_step = ~skipped[pos]
        out.sampled[pos] = True
        best = _first_nonfinite(rows, kind, bad, best)
        best_fwd = _first_nonfinite(rows, kind, bad & (kind == Kind.OUTPUT), best_fwd)
        best_bwd = _first_nonfinite(rows, kind, bad & (kind == Kind.GRAD_OUTPUT), best_bwd)
        _reduce_outputs(out, rows, pos, tid, kind == Kind.OUTPUT, bad, pre)
        _reduce_grads(out, rows, pos, tid, (kind == Kind.PARAM_GRAD) & ~bad & clean_step,
                      pre, sub_col)
        _reduce_params(out, rows, pos, tid, kind == Kind.PARAM, pre & clean_step)
        _reduce_flags(out, rows, pos, tid, kind, bad)
    out.first_nonfinite = _located(best, kinds, names)
    out.first_forward = _located(best_fwd, kinds, names)
    out.first_backward = _located(best_bwd, kinds, names)
    return out


def _located(best: Optional[tuple], kinds: np.ndarray, names: list) -> Optional[dict]:
    if best is None:
        return None
    step, _order, _seq, tensor = best
    return {"step": int(step), "module": names[tensor] if tensor < len(names) else None,
            "phase": _PHASE_ORDER.get(int(kinds[tensor]), (9, "unknown"))[1],
            "kind": int(kinds[tensor]), "tensor": int(tensor)}


# Execution order of the kinds within a step, indexed by Kind (-1, unknown, sorts last).
_ORDER_OF_KIND = np.full(len(Kind) + 1, 9, np.int64)
for _k, (_o, _) in _PHASE_ORDER.items():
    _ORDER_OF_KIND[_k] = _o


def _first_nonfinite(rows, kind, bad, best):
    if not bad.any():
        return best
    sel = np.flatnonzero(bad)
    order = _ORDER_OF_KIND[kind[sel]]
    key = np.lexsort((rows["seq"][sel], order, rows["step"][sel]))[0]
    i = sel[key]
    cand = (int(rows["step"][i]), int(order[key]), int(rows["seq"][i]), int(rows["tensor"][i]))
    return cand if best is None or cand < best else best


def _reduce_outputs(out: Stats, rows, pos, tid, sel, bad, pre) -> None:
    if not sel.any():
        return
    r, p, t, b = rows[sel], pos[sel], tid[sel], bad[sel]
    absmax = np.where(np.isfinite(r["absmax"]), r["absmax"], np.nan).astype(np.float64)
    np.fmax.at(out.out_absmax, p, absmax)
    np.add.at(out.out_near, p, (r["near16"] > 0).astype(np.int64))
    np.add.at(out.out_bad, p, b.astype(np.int64))
    pr = pre[sel] & ~b
    if pr.any():
        np.fmax.at(out.out_max, t[pr], absmax[pr])
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = r["near16"][pr] / np.maximum(r["sample_n"][pr], 1)
        np.maximum.at(out.near_max, t[pr], frac)
    _reduce_dead_outputs(out, r, t, b)


def _reduce_dead_outputs(out: Stats, r, t, bad) -> None:
    """Module outputs that are exactly 0 everywhere (absmax is exact over the whole tensor):
    a ReLU layer whose every unit is dead for the whole batch. One-element outputs (a scalar
    auxiliary loss) are left out."""
    zero = (r["absmax"] == 0) & ~bad & (r["numel"] >= 2)
    alive = ~zero & ~bad
    if alive.any():
        np.maximum.at(out.out_alive_step, t[alive], r["step"][alive])
    # Rows arrive in step order: the last occurrence of a tensor is its latest sample.
    rev_t, rev_i = np.unique(t[::-1], return_index=True)
    out.out_zero_last[rev_t] = zero[::-1][rev_i]
    out.out_seen_step[rev_t] = r["step"][::-1][rev_i]


# Exact zeros in a gradient count as flushed only when its non-zero values sit this deep in
# the subnormal band: zeros beside healthy values are structural (dead units, masked
# positions, embedding rows the batch did not use), and a large vocabulary makes most of an
# embedding's gradient such zeros.
ZEROS_FLUSHED_IF = 0.25


def _reduce_grads(out: Stats, rows, pos, tid, sel, pre, sub_col: str) -> None:
    """Underflow of each gradient. Per tensor: the fraction of its non-zero elements that the
    low precision held as subnormals (precision lost; the tail beyond flushed to zero). Per
    step: elements subnormal, plus zeros where the non-zero values are that low."""
    if not sel.any():
        return
    r, p, t = rows[sel], pos[sel], tid[sel]
    n = np.maximum(r["sample_n"], 1).astype(np.float64)
    sub = r[sub_col].astype(np.float64)
    nonzero = n - r["zeros"]
    with np.errstate(invalid="ignore", divide="ignore"):
        deep = np.where(nonzero > 0, sub / np.maximum(nonzero, 1), np.nan)
    flushed = np.where(deep >= ZEROS_FLUSHED_IF, r["zeros"], 0).astype(np.float64)
    np.add.at(out.grad_under, p, sub + flushed)
    np.add.at(out.grad_n, p, n)
    zero_frac = r["zeros"] / n
    size = np.maximum(r["numel"], 1).astype(np.float64)
    np.add.at(out.grad_zero, p, zero_frac * size)
    np.add.at(out.grad_numel, p, size)
    rev_t, rev_i = np.unique(t[::-1], return_index=True)
    out.grad_zero_last[rev_t] = zero_frac[::-1][rev_i]
    pr = pre[sel] & np.isfinite(deep)
    if pr.any():
        np.add.at(out.under_sum, t[pr], deep[pr])
        np.add.at(out.zero_sum, t[pr], (r["zeros"] / n)[pr])
        np.add.at(out.under_cnt, t[pr], 1.0)
    rms = r["rms"].astype(np.float64)
    pr = pre[sel] & np.isfinite(rms) & (rms > 0)
    if pr.any():
        np.add.at(out.grms_sum, t[pr], np.log10(rms[pr]))
        np.add.at(out.grms_cnt, t[pr], 1.0)


def _reduce_params(out: Stats, rows, pos, tid, sel, pre_clean) -> None:
    if not sel.any():
        return
    r, p, t = rows[sel], pos[sel], tid[sel]
    norm = r["norm"].astype(np.float64)
    fin = np.isfinite(norm)
    np.add.at(out.wnorm2, p[fin], norm[fin] ** 2)
    np.add.at(out.wcount, p[fin], 1)
    np.add.at(out.param_bad, p[~fin], 1)
    # Update ratios, as log10, clipped and weighted by size: a zero-initialised bias has
    # |dW|/|W| of 1e300 on its first step, and must not outvote the weight matrices.
    upd = r["update"].astype(np.float64)
    good = np.isfinite(upd) & (upd > 0) & fin & (norm > TINY_NORM)
    with np.errstate(divide="ignore"):
        lu = np.clip(np.log10(np.where(good, upd, 1.0)), -12.0, 1.0)
    size = np.maximum(r["numel"], 1).astype(np.float64)
    np.add.at(out._upd_sum, p[good], (lu * size)[good])
    np.add.at(out._upd_cnt, p[good], size[good])
    unch = r["unchanged"].astype(np.float64)
    u_ok = np.isfinite(unch)
    wts = np.maximum(r["sample_n"], 1).astype(np.float64)
    np.add.at(out._unch_sum, p[u_ok], (unch * wts)[u_ok])
    np.add.at(out._unch_n, p[u_ok], wts[u_ok])
    pc = pre_clean[sel]
    if pc.any():
        # First and last norm per tensor: rows arrive in step order, so the first write of a
        # tensor (seen once) and the last write win.
        tt, nn_, ss = t[pc & fin], norm[pc & fin], r["step"][pc & fin]
        if len(tt):
            first = out.norm_first_step[tt] < 0
            uniq, idx = np.unique(tt[first], return_index=True)
            out.norm_first[uniq] = nn_[first][idx]
            out.norm_first_step[uniq] = ss[first][idx]
            rev_u, rev_idx = np.unique(tt[::-1], return_index=True)
            out.norm_last[rev_u] = nn_[::-1][rev_idx]
        g = pc & good
        np.add.at(out.upd_sum, t[g], lu[g])
        np.add.at(out.upd_cnt, t[g], 1.0)
        g = pc & u_ok
        np.add.at(out.unch_sum, t[g], unch[g])
        np.add.at(out.unch_cnt, t[g], 1.0)


def _reduce_flags(out: Stats, rows, pos, tid, kind, bad) -> None:
    for k, target in ((Kind.BUFFER, out.buffer_bad), (Kind.INPUT, out.input_bad)):
        sel = (kind == k) & bad
        if sel.any():
            np.add.at(target, pos[sel], 1)
    inp = kind == Kind.INPUT
    if inp.any():
        np.add.at(out.input_over, pos[inp], rows["over16"][inp].astype(np.int64))
        a = rows["absmax"][inp].astype(np.float64)
        np.fmax.at(out.input_absmax, pos[inp], np.where(np.isfinite(a), a, np.nan))
    bad_t = tid[bad]
    if len(bad_t):
        first = out.first_bad_step[bad_t] < 0
        uniq, idx = np.unique(bad_t[first], return_index=True)
        out.first_bad_step[uniq] = rows["step"][bad][first][idx]
    rev_t, rev_i = np.unique(tid[::-1], return_index=True)
    out.last_step[rev_t] = rows["step"][::-1][rev_i]
    out.last_bad[rev_t] = bad[::-1][rev_i]


# ---------------------------------------------------------------------------------------------
# Facts



# -- the run's precision: decided here once, for the diagnosis and the release material ------


def autocast_dtype(run: Any) -> Optional[str]:
    """The dtype autocast computed in, or None when it was off (or never seen)."""
    ac = run.autocast
    return ac.get("dtype") if ac is not None and ac.get("enabled") else None


def param_dtypes(run: Any) -> dict[str, int]:
    """Elements per dtype of the trained parameters (optimizer's view, else the model's)."""
    out: dict[str, int] = {}
    for o in run.optimizers:
        for k, v in (o.get("param_dtypes") or {}).items():
            out[k] = out.get(k, 0) + int(v)
    if not out and run.model is not None:
        out = {k: int(v) for k, v in (run.model.get("param_dtypes") or {}).items()}
    return out


def params_mostly(run: Any, dtype: str) -> bool:
    d = param_dtypes(run)
    total = sum(d.values())
    return bool(total) and d.get(dtype, 0) * 2 >= total


def low_precision(run: Any) -> Optional[str]:
    """'fp16', 'bf16' or None: the narrow float type the run computes in (autocast's dtype,
    else the trained weights' when they are mostly half, else an fp16 loss).

    Example::

        low_precision(ampdoctor.load("run.h5"))   # 'fp16'
    """
    ac = autocast_dtype(run)
    if ac == "float16" or params_mostly(run, "float16"):
        return "fp16"
    if ac == "bfloat16" or params_mostly(run, "bfloat16"):
        return "bf16"
    if len(run.steps) and np.any(run.steps["loss_dtype"] == DType.FLOAT16):
        return "fp16"
    return None


class Facts:
    """Derived views of a ``Run`` for the rules. Properties are computed on first use.

    Example::

        f = Facts(ampdoctor.load("run.h5"))
        f.precision, f.story.collapsed, f.stats.layer_under
    """

    def __init__(self, run: Any, chunk: int = 1 << 16):
        self.run = run
        self.steps = run.steps
        self.meta = run.meta
        self.chunk = chunk
        self._cache: dict[str, Any] = {}

    def _memo(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    # -- configuration ---------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def autocast_dtype(self) -> Optional[str]:
        return autocast_dtype(self.run)

    @property
    def device_type(self) -> str:
        ac = self.run.autocast
        if ac is not None and ac.get("device_type"):
            return str(ac["device_type"])
        dev = self.run.device
        return str(dev.get("type", "cuda")) if dev is not None else "cuda"

    @property
    def root_names(self) -> set[str]:
        """Names the recorder gives the root module(s): its class name, for a single root."""
        return set(self.run.roots)

    @property
    def optimizers(self) -> list[dict]:
        return self.run.optimizers

    @property
    def param_dtypes(self) -> dict[str, int]:
        """Elements per dtype of the trained parameters (optimizer's view, else the model's)."""
        return param_dtypes(self.run)

    def params_mostly(self, dtype: str) -> bool:
        return params_mostly(self.run, dtype)

    @property
    def low_precision(self) -> Optional[str]:
        """'fp16', 'bf16' or None: the narrow float type the run computes in."""
        return low_precision(self.run)

    @property
    def scaler(self) -> Optional[dict]:
        return self.run.scaler

    @property
    def has_scaler(self) -> bool:
        return self.story.has_scaler

    # -- steps -----------------------------------------------------------------------------

    @property
    def step_values(self) -> np.ndarray:
        return self.steps["step"]

    @property
    def skipped(self) -> np.ndarray:
        return self.steps["skipped"] == 1

    @property
    def loss_bad(self) -> np.ndarray:
        return (self.steps["flags"] & flag(Event.NONFINITE_LOSS)) != 0

    @property
    def grad_bad(self) -> np.ndarray:
        return (self.steps["flags"] & flag(Event.NONFINITE_GRAD)) != 0

    @property
    def loss_ok(self) -> np.ndarray:
        loss = self.steps["loss"]
        return np.isfinite(loss)

    def step_at(self, index: int) -> int:
        return int(self.steps["step"][index])

    def index_of(self, step: int) -> int:
        return int(min(np.searchsorted(self.steps["step"], step), max(self.n - 1, 0)))

    def first(self, mask: np.ndarray) -> Optional[int]:
        """Step number of the first True in a per-step mask."""
        idx = np.flatnonzero(mask)
        return int(self.steps["step"][idx[0]]) if len(idx) else None

    @property
    def curve(self) -> curve.Curve:
        """The loss curve read once: start and end levels, noise, spikes (``curve.read``)."""
        return self._memo("curve", lambda: curve.read(self.steps["loss"]))

    @property
    def story(self) -> ScaleStory:
        return self._memo("story", lambda: scale_story(self.steps, self.scaler, self.loss_bad))

    @property
    def failure_index(self) -> Optional[int]:
        """Position of the first failing step: the first non-finite loss or the start of the
        skipping that lasts to the end, whichever is first; else the first skipped step that
        GradScaler's calibration and probing do not explain. Without a scaler a non-finite
        gradient is applied to the weights, so it starts the failure too."""
        def find():
            if not self.n:
                return None
            # A non-finite loss, or skipping that goes on to the end, is the failure; the
            # unexplained skips before it are the scale's staircase on the way there.
            applied = self.grad_bad if not self.story.has_scaler else np.zeros(self.n, bool)
            starts = [int(i[0]) for i in (np.flatnonzero(self.loss_bad | applied),) if len(i)]
            if self.story.terminal_run:
                starts.append(self.n - self.story.terminal_run)
            if starts:
                return self._walk_back(min(starts))
            bad = self.story.bad_skip | (self.grad_bad if not self.story.has_scaler else False)
            idx = np.flatnonzero(bad)
            return int(idx[0]) if len(idx) else None
        return self._memo("failure_index", find)

    def _walk_back(self, i: int) -> int:
        """Back over the unexplained skips that lead into the failure (the scale's staircase),
        across single applied steps between them."""
        bad = self.story.bad_skip
        while i > 0:
            if bad[i - 1]:
                i -= 1
            elif i > 1 and bad[i - 2]:
                i -= 2
            else:
                break
        return i

    @property
    def failure_step(self) -> Optional[int]:
        i = self.failure_index
        return None if i is None else self.step_at(i)

    @property
    def horizon(self) -> int:
        """Step number where pre-failure reductions stop (failure step, or past the end)."""
        s = self.failure_step
        return int(s) if s is not None else (int(self.steps["step"][-1]) + 1 if self.n else 0)

    # -- events and snapshots --------------------------------------------------------------

    def events(self, kind: Event) -> np.ndarray:
        ev = self.run.events
        return ev[ev["kind"] == int(kind)]

    @property
    def stopped(self) -> Optional[dict]:
        """Where and why ampdoctor stopped recording (an internal fault), or None."""
        return recording_stopped(self.run)

    @property
    def exception(self) -> Optional[tuple[str, str]]:
        """(type, message) of the exception the training script raised, if any."""
        rows = self.events(Event.EXCEPTION)
        status = self.run.status
        if len(rows):
            text = str(rows["text"][-1])
            typ, _, msg = text.partition(": ")
            return typ, msg
        if status.startswith(schema.STATUS_EXCEPTION):
            return status.split(":", 1)[1], ""
        return None

    @property
    def snapshots(self) -> list[dict]:
        """Forensic replays, oldest first, as dicts (detail JSON parsed)."""
        def build():
            out = []
            for s in self.run.snapshots:
                try:
                    detail = json.loads(s["detail"]) if s["detail"] else {}
                except ValueError:
                    detail = {}
                out.append({"id": int(s["id"]), "step": int(s["step"]),
                            "phase": _phase_name(int(s["phase"])),
                            "module": str(s["module"]) or None,
                            "module_type": str(s["module_type"]) or None,
                            "fp32_finite": int(s["fp32_finite"]),
                            "fp32_absmax": float(s["fp32_absmax"]),
                            "in_absmax": float(s["in_absmax"]),
                            "out_absmax": float(s["out_absmax"]),
                            "scale": float(s["scale"]), "lr": float(s["lr"]),
                            "trigger": int(s["trigger"]), "detail": detail})
            return out
        return self._memo("snapshots", build)

    def batch_absmax(self, snapshot_id: int) -> tuple[float, bool]:
        """Largest finite magnitude in a snapshot's saved float batch, and whether it held
        NaN/inf. Only the batch ("args.*", "kwargs.*"): not the culprit's own inputs, the
        output gradient or the RNG state saved beside it."""
        arrays = self.run.arrays
        rows = np.flatnonzero(arrays["snapshot"] == snapshot_id)
        biggest, bad = math.nan, False
        for r in rows:
            name = str(arrays["name"][r])
            if not name.startswith(("args.", "kwargs.")):
                continue
            try:
                a = self.run.array(int(r))
            except Exception:  # noqa: BLE001 - a damaged array must not stop the diagnosis
                continue
            if a.dtype.kind != "f" or not a.size:
                continue
            fin = np.isfinite(a)
            bad = bad or not bool(fin.all())
            if fin.any():
                m = float(np.abs(a[fin]).max())
                biggest = m if math.isnan(biggest) else max(biggest, m)
        return biggest, bad

    # -- tensors and statistics ------------------------------------------------------------

    @property
    def tensor_kinds(self) -> np.ndarray:
        def build():
            t = self.run.tensors
            size = int(t["id"].max()) + 1 if len(t) else 0
            kinds = np.full(size, -1, np.int64)
            kinds[t["id"]] = t["kind"]
            return kinds
        return self._memo("kinds", build)

    @property
    def tensor_names(self) -> list[str]:
        def build():
            t = self.run.tensors
            size = int(t["id"].max()) + 1 if len(t) else 0
            names = [""] * size
            for i, name in zip(t["id"], t["name"]):
                names[int(i)] = str(name)
            return names
        return self._memo("names", build)

    @property
    def tensor_types(self) -> list[str]:
        def build():
            t = self.run.tensors
            size = int(t["id"].max()) + 1 if len(t) else 0
            types = [""] * size
            for i, ty in zip(t["id"], t["type"]):
                types[int(i)] = str(ty)
            return types
        return self._memo("types", build)

    def module_type(self, name: str) -> Optional[str]:
        """Class of the module called ``name`` (from its OUTPUT row), if recorded."""
        kinds, names, types = self.tensor_kinds, self.tensor_names, self.tensor_types
        for i, n in enumerate(names):
            if n == name and kinds[i] == Kind.OUTPUT:
                return types[i] or None
        return None

    @property
    def stats(self) -> Stats:
        return self._memo("stats", lambda: stream_stats(
            self.run, self.tensor_kinds, self.tensor_names, self.step_values, self.skipped,
            self.horizon, self.low_precision or "fp16", self.chunk))

    def first_nonfinite_sampled(self) -> Optional[dict]:
        """The first non-finite tensor in the sampled tier: {"step", "module", "phase"}."""
        x = self.stats.first_nonfinite
        return {k: x[k] for k in ("step", "module", "phase")} if x else None

    @property
    def sampled_steps(self) -> int:
        return int(self.stats.sampled.sum())

    def window(self, step: int, before: int = 5, after: int = 2) -> dict:
        """Scale, LR, loss and grad norm around ``step`` (for the report)."""
        s = self.steps
        i = self.index_of(step)
        sel = slice(max(0, i - before), min(self.n, i + after + 1))
        return {k: [_num(v) for v in s[k][sel]] for k in ("step", "loss", "scale", "lr",
                                                          "grad_norm", "skipped")}


def recording_stopped(run: Any) -> Optional[dict]:
    """``{"step", "why"}`` when ampdoctor stepped aside after an internal fault (its
    RECORDER_ERROR event): the file holds the steps before ``step`` and nothing after.

    Example::

        recording_stopped(ampdoctor.load("run.h5"))
        # {'step': 0, 'why': "before_clip: RuntimeError: aten.take.default got mixed ..."}
    """
    ev = run.events
    rows = ev[ev["kind"] == int(Event.RECORDER_ERROR)]
    if not len(rows):
        return None
    return {"step": int(rows["step"][0]), "why": str(rows["text"][0])}


def _phase_name(code: int) -> str:
    try:
        return PHASES[Phase(code)]
    except ValueError:
        return "unknown"


def _num(v: Any) -> Any:
    """A plain Python number; NaN stays NaN (the text report prints it, JSON makes it null)."""
    return v.item() if isinstance(v, np.generic) else v
