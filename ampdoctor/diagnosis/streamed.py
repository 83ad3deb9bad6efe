"""The streamed reduction of the /stats table: one pass over it in chunks, keeping per tensor
and per step only what the rules read (``Reduced``), so a run of millions of rows diagnoses in
bounded memory.

Example::

    reduced = stream_stats(run, kinds, names, step_values, ...)   # see Facts.reduced
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..runfile import schema
from ..runfile.schema import Kind, Source
from .sampled import PerStep, SampledSteps
from .thresholds import UNCHANGED_HIGH

# A weight whose norm is below this is (close to) zero-initialised: its update ratio says
# nothing about the step size.
TINY_NORM = 1e-6

# ---------------------------------------------------------------------------------------------
# The sampled statistics, streamed once


# Columns read from /stats; nothing else is loaded.
_COLUMNS = schema.columns("stats", "step", "tensor", "seq", "source", "nonfinite", "numel",
                          "sample_n", "zeros", "sub16", "subbf16", "near16", "over16", "absmax",
                          "rms", "norm", "update", "unchanged")


_I, _F = np.int64, np.float64
_PER_STEP = {"out_absmax": (_F, np.nan), "out_near": (_I, 0), "out_bad": (_I, 0),
             "grad_under": (_F, 0.0), "grad_n": (_F, 0.0), "wnorm2": (_F, 0.0),
             "wcount": (_I, 0), "param_bad": (_I, 0), "upd_sum": (_F, 0.0),
             "upd_cnt": (_F, 0.0), "unch_sum": (_F, 0.0), "unch_n": (_F, 0.0),
             "buffer_bad": (_I, 0), "input_bad": (_I, 0), "input_over": (_I, 0),
             "input_absmax": (_F, np.nan), "grad_zero": (_F, 0.0), "grad_numel": (_F, 0.0)}


@dataclass
class Reduced:
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
      step with a non-zero value), out_seen_step (last sampled step), layer_out_zeros (mean
      share of its sampled elements that are exactly 0); for gradients,
      grad_zero_last (share of exact zeros at the tensor's last sample), and for them and the
      gradients arriving at module outputs, grad_rows / zero_rows (clean sampled steps seen,
      and those on which the whole tensor was exactly 0: ``always_zero``); for parameters,
      stuck_first (the first sampled step of the streak, up to the horizon, on which each
      step left >= UNCHANGED_HIGH of its sampled elements unchanged although their gradient
      was not 0; -1: none), moving_last (the last sampled step that moved it).
    """

    n_steps: int
    n_tensors: int
    rows: int = 0
    first_nonfinite: Optional[dict] = None  # step, module, phase, kind, tensor
    first_forward: Optional[dict] = None  # the same, for module outputs only
    first_backward: Optional[dict] = None  # ... for gradients arriving at module outputs

    def __post_init__(self) -> None:
        t = self.n_tensors
        self.per_step = SampledSteps(self.n_steps, _PER_STEP)
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
        self.out_zero_last = np.zeros(t, bool)
        self.out_alive_step = np.full(t, -1, np.int64)
        self.out_seen_step = np.full(t, -1, np.int64)
        self.out_zero_sum = np.zeros(t)
        self.out_zero_cnt = np.zeros(t)
        self.grad_zero_last = np.full(t, np.nan)
        self.grad_rows = np.zeros(t, np.int64)
        self.zero_rows = np.zeros(t, np.int64)
        self.stuck_first = np.full(t, -1, np.int64)
        self.moving_last = np.full(t, -1, np.int64)
        self.buf_first_step = np.full(t, -1, np.int64)
        self.buf_first_bad = np.zeros(t, bool)
        self.buf_finite_step = np.full(t, -1, np.int64)
        self.buf_changed = np.zeros(t, bool)
        self._buf_sig = np.full((t, len(_BUFFER_SIG)), np.nan)

    # The per-step arrays, held over the sampled steps only (``sampled.SampledSteps``) and
    # read over every step: NaN or 0 where nothing was sampled.
    out_absmax = PerStep()
    out_near = PerStep()
    out_bad = PerStep()
    grad_under = PerStep()
    grad_n = PerStep()
    wnorm2 = PerStep()
    wcount = PerStep()
    param_bad = PerStep()
    buffer_bad = PerStep()
    input_bad = PerStep()
    input_over = PerStep()
    input_absmax = PerStep()
    grad_zero = PerStep()
    grad_numel = PerStep()

    @property
    def sampled(self) -> np.ndarray:
        return self.per_step.seen()

    def _ratio(self, num: str, den: str) -> np.ndarray:
        """Per step: ``num / den`` of the parts, NaN where ``den`` is 0 or nothing was
        sampled."""
        part = self.per_step.parts
        with np.errstate(invalid="ignore", divide="ignore"):
            held = np.where(part[den] > 0, part[num] / np.maximum(part[den], 1), np.nan)
        return self.per_step.spread(held, np.nan)

    @property
    def upd_log(self) -> np.ndarray:
        return self._ratio("upd_sum", "upd_cnt")

    @property
    def unchanged(self) -> np.ndarray:
        return self._ratio("unch_sum", "unch_n")

    @property
    def grad_zero_share(self) -> np.ndarray:
        """Per step: share of the trained parameters' gradient elements that are exactly 0
        (NaN where no gradient was sampled)."""
        return self._ratio("grad_zero", "grad_numel")

    @property
    def always_zero(self) -> np.ndarray:
        """Per tensor (a parameter's gradient, or the gradient arriving at a module's output):
        exactly 0 in every element on every clean sampled step it was seen on."""
        return (self.grad_rows > 0) & (self.zero_rows == self.grad_rows)

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
    def layer_out_zeros(self) -> np.ndarray:
        """Mean share of each module output's sampled elements that are exactly 0."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.out_zero_cnt > 0, self.out_zero_sum / np.maximum(
                self.out_zero_cnt, 1), np.nan)

    @property
    def layer_unchanged(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.unch_cnt > 0, self.unch_sum / np.maximum(self.unch_cnt, 1),
                            np.nan)

    @property
    def layer_update(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.upd_cnt > 0, self.upd_sum / np.maximum(self.upd_cnt, 1), np.nan)


# The statistics that tell whether a buffer changed between two samples.
_BUFFER_SIG = ("nonfinite", "zeros", "absmax", "rms")


_PHASE_ORDER = {int(Kind.INPUT): (0, "input"), int(Kind.OUTPUT): (1, "forward"),
                int(Kind.GRAD_OUTPUT): (2, "backward"), int(Kind.PARAM_GRAD): (3, "backward"),
                int(Kind.PARAM): (4, "optimizer"), int(Kind.BUFFER): (5, "buffer")}


def stream_stats(run: Any, kinds: np.ndarray, names: list, step_values: np.ndarray,
                 skipped: np.ndarray, horizon: int, low: str, chunk: int = 1 << 16,
                 still: Optional[np.ndarray] = None) -> Reduced:
    """One pass over /stats (SAMPLED rows), ``chunk`` rows at a time, vectorised per chunk.

    ``kinds``/``names``: tensor id -> Kind / name. ``step_values``: run.steps["step"] (sorted).
    ``horizon``: step number where the failure starts (pre-failure reductions stop there).
    ``low``: the run's low precision, "fp16" or "bf16" (which subnormal band counts).
    ``still``: per step, True where the LR of every group was 0 (a warm-up's first step): its
    optimizer step asked for no update, so what it left unchanged is not measured.
    """
    n, t = len(step_values), len(kinds)
    still = np.zeros(n, bool) if still is None else still
    out = Reduced(n, t)
    sub_col = "subbf16" if low == "bf16" else "sub16"
    best: Optional[tuple] = None
    best_fwd: Optional[tuple] = None
    best_bwd: Optional[tuple] = None
    zero_grads: set[tuple[int, str]] = set()  # (step, parameter) whose gradient was exactly 0
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
        k = out.per_step.index(pos)  # where each row's step is held
        tid = rows["tensor"].astype(np.int64)
        kind = kinds[tid]
        bad = rows["nonfinite"] > 0
        pre = rows["step"] < horizon
        clean_step = ~skipped[pos]
        best = _first_nonfinite(rows, kind, bad, best)
        best_fwd = _first_nonfinite(rows, kind, bad & (kind == Kind.OUTPUT), best_fwd)
        best_bwd = _first_nonfinite(rows, kind, bad & (kind == Kind.GRAD_OUTPUT), best_bwd)
        _reduce_outputs(out, rows, k, tid, kind == Kind.OUTPUT, bad, pre)
        _reduce_grads(out, rows, k, tid, (kind == Kind.PARAM_GRAD) & ~bad & clean_step,
                      pre, sub_col)
        no_grad = _zero_grad_params(rows, tid, kind, bad, names, zero_grads) | still[pos]
        _reduce_params(out, rows, k, tid, kind == Kind.PARAM, pre & clean_step, no_grad)
        _reduce_zero_grads(out, rows, tid, ((kind == Kind.PARAM_GRAD) | (
            kind == Kind.GRAD_OUTPUT)) & ~bad & clean_step)
        _reduce_flags(out, rows, k, tid, kind, bad)
        _reduce_buffers(out, rows, tid, kind == Kind.BUFFER, bad)
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


def _reduce_outputs(out: Reduced, rows: np.ndarray, pos: np.ndarray, tid: np.ndarray,
                    sel: np.ndarray, bad: np.ndarray, pre: np.ndarray) -> None:
    if not sel.any():
        return
    r, p, t, b = rows[sel], pos[sel], tid[sel], bad[sel]
    absmax = np.where(np.isfinite(r["absmax"]), r["absmax"], np.nan).astype(np.float64)
    part = out.per_step.parts
    np.fmax.at(part["out_absmax"], p, absmax)
    np.add.at(part["out_near"], p, (r["near16"] > 0).astype(np.int64))
    np.add.at(part["out_bad"], p, b.astype(np.int64))
    pr = pre[sel] & ~b
    if pr.any():
        np.fmax.at(out.out_max, t[pr], absmax[pr])
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = r["near16"][pr] / np.maximum(r["sample_n"][pr], 1)
        np.maximum.at(out.near_max, t[pr], frac)
    _reduce_dead_outputs(out, r, t, b)
    ok = ~b & (r["sample_n"] > 0)
    np.add.at(out.out_zero_sum, t[ok], r["zeros"][ok] / r["sample_n"][ok])
    np.add.at(out.out_zero_cnt, t[ok], 1.0)


def _reduce_dead_outputs(out: Reduced, r: np.ndarray, t: np.ndarray, bad: np.ndarray) -> None:
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


def _reduce_grads(out: Reduced, rows: np.ndarray, pos: np.ndarray, tid: np.ndarray,
                  sel: np.ndarray, pre: np.ndarray, sub_col: str) -> None:
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
    part = out.per_step.parts
    np.add.at(part["grad_under"], p, sub + flushed)
    np.add.at(part["grad_n"], p, n)
    zero_frac = r["zeros"] / n
    size = np.maximum(r["numel"], 1).astype(np.float64)
    np.add.at(part["grad_zero"], p, zero_frac * size)
    np.add.at(part["grad_numel"], p, size)
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


def _reduce_zero_grads(out: Reduced, rows: np.ndarray, tid: np.ndarray, sel: np.ndarray
                       ) -> None:
    """Gradients that are exactly 0 everywhere (absmax is exact over the whole tensor)."""
    if sel.any():
        np.add.at(out.grad_rows, tid[sel], 1)
        np.add.at(out.zero_rows, tid[sel], (rows["absmax"][sel] == 0).astype(np.int64))


def _zero_grad_params(rows: np.ndarray, tid: np.ndarray, kind: np.ndarray, bad: np.ndarray,
                      names: list, seen: set) -> np.ndarray:
    """Per row: a parameter whose gradient was exactly 0 on the same step (zero by
    construction: the layers behind a zero-initialised BatchNorm scale, the last norm of a
    residual block, get none on the first step). Its update is weight decay or momentum
    alone, no measure of the step size: it is left out of the update ratios. ``seen`` carries
    the last step's zero gradients over a chunk's boundary."""
    zero = (kind == Kind.PARAM_GRAD) & (rows["absmax"] == 0) & ~bad
    seen.update((int(s), names[t]) for s, t in zip(rows["step"][zero], tid[zero]))
    out = np.zeros(len(rows), bool)
    params = np.flatnonzero(kind == Kind.PARAM)
    if seen and len(params):
        out[params] = [(int(rows["step"][i]), names[tid[i]]) in seen for i in params]
    last = int(rows["step"][-1]) if len(rows) else 0
    for key in [k for k in seen if k[0] < last]:
        seen.discard(key)
    return out


def _reduce_params(out: Reduced, rows: np.ndarray, pos: np.ndarray, tid: np.ndarray,
                   sel: np.ndarray, pre_clean: np.ndarray, no_grad: np.ndarray) -> None:
    if not sel.any():
        return
    r, p, t = rows[sel], pos[sel], tid[sel]
    norm = r["norm"].astype(np.float64)
    fin = np.isfinite(norm)
    part = out.per_step.parts
    np.add.at(part["wnorm2"], p[fin], norm[fin] ** 2)
    np.add.at(part["wcount"], p[fin], 1)
    np.add.at(part["param_bad"], p[~fin], 1)
    # Update ratios, as log10, clipped and weighted by size: a zero-initialised bias has
    # |dW|/|W| of 1e300 on its first step, and must not outvote the weight matrices.
    upd = r["update"].astype(np.float64)
    good = np.isfinite(upd) & (upd > 0) & fin & (norm > TINY_NORM) & ~no_grad[sel]
    with np.errstate(divide="ignore"):
        lu = np.clip(np.log10(np.where(good, upd, 1.0)), -12.0, 1.0)
    size = np.maximum(r["numel"], 1).astype(np.float64)
    np.add.at(part["upd_sum"], p[good], (lu * size)[good])
    np.add.at(part["upd_cnt"], p[good], size[good])
    # The unchanged share is of the elements whose gradient was not 0: a parameter with none
    # on this step is not measured (files written before the recorder said so with NaN hold
    # 0.0 there, which outvoted the updates that did round away: timm's zero-initialised
    # residual branches at step 0).
    unch = r["unchanged"].astype(np.float64)
    u_ok = np.isfinite(unch) & ~no_grad[sel]
    wts = np.maximum(r["sample_n"], 1).astype(np.float64)
    np.add.at(part["unch_sum"], p[u_ok], (unch * wts)[u_ok])
    np.add.at(part["unch_n"], p[u_ok], wts[u_ok])
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
        _reduce_stuck(out, t[g], r["step"][g], unch[g])


def _reduce_stuck(out: Reduced, t: np.ndarray, step: np.ndarray, unch: np.ndarray) -> None:
    """Each parameter's streak of steps that left it unchanged, up to its latest sample: a
    step that moved it ends the streak (rows arrive in step order)."""
    moving = unch < UNCHANGED_HIGH
    last = out.moving_last.copy()
    np.maximum.at(last, t[moving], step[moving])
    out.stuck_first[last != out.moving_last] = -1  # moved in this chunk: a new streak
    out.moving_last = last
    stuck = ~moving & (step > last[t])
    first = np.where(out.stuck_first >= 0, out.stuck_first, np.iinfo(np.int64).max)
    np.minimum.at(first, t[stuck], step[stuck])
    out.stuck_first = np.where(first < np.iinfo(np.int64).max, first, -1)


def _reduce_buffers(out: Reduced, rows: np.ndarray, tid: np.ndarray, sel: np.ndarray,
                    bad: np.ndarray) -> None:
    """Was each buffer finite at some sample, and did it change between samples? (Rows arrive
    in step order: a tensor's first row seen is its first sample.)"""
    if not sel.any():
        return
    r, t, b = rows[sel], tid[sel], bad[sel]
    sig = np.stack([r[c].astype(np.float64) for c in _BUFFER_SIG], axis=1)
    new = out.buf_first_step[t] < 0
    uniq, idx = np.unique(t[new], return_index=True)
    out.buf_first_step[uniq] = r["step"][new][idx]
    out.buf_first_bad[uniq] = b[new][idx]
    out._buf_sig[uniq] = sig[new][idx]
    same = np.all((sig == out._buf_sig[t]) | (np.isnan(sig) & np.isnan(out._buf_sig[t])), axis=1)
    out.buf_changed[t[~same]] = True
    fin = ~b & (out.buf_finite_step[t] < 0)
    uniq, idx = np.unique(t[fin], return_index=True)
    out.buf_finite_step[uniq] = r["step"][fin][idx]


def _reduce_flags(out: Reduced, rows: np.ndarray, pos: np.ndarray, tid: np.ndarray,
                  kind: np.ndarray, bad: np.ndarray) -> None:
    part = out.per_step.parts
    for k, target in ((Kind.BUFFER, "buffer_bad"), (Kind.INPUT, "input_bad")):
        sel = (kind == k) & bad
        if sel.any():
            np.add.at(part[target], pos[sel], 1)
    inp = kind == Kind.INPUT
    if inp.any():
        np.add.at(part["input_over"], pos[inp], rows["over16"][inp].astype(np.int64))
        a = rows["absmax"][inp].astype(np.float64)
        np.fmax.at(part["input_absmax"], pos[inp], np.where(np.isfinite(a), a, np.nan))
    bad_t = tid[bad]
    if len(bad_t):
        first = out.first_bad_step[bad_t] < 0
        uniq, idx = np.unique(bad_t[first], return_index=True)
        out.first_bad_step[uniq] = rows["step"][bad][first][idx]
    rev_t, rev_i = np.unique(tid[::-1], return_index=True)
    out.last_step[rev_t] = rows["step"][::-1][rev_i]
    out.last_bad[rev_t] = bad[::-1][rev_i]
