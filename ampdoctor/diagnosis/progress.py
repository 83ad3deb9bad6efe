"""What the sampled tier and the loss curve say of a run's progress, read by more than one
rule family and by the engine: the dead units at the end of the run (``dead_units``), whether
fp32 would have done the same (``precision_answer``), a run no other rule found trouble in
(``untroubled``), the loss's fall against its own noise (``loss_evidence``), and the warnings a
healthy verdict carries (``flat_warning``, ``recovered_spike``).

The verdicts are ``rules/progress.py``'s (``diverged``, ``dead_units``) and
``rules/learning.py``'s (``not_learning``); ``rules/hidden.py`` shows ``loss_evidence`` too.
numpy only (no torch).

Example::

    dead_units(f).layers            # ['trunk.2']: outputs exactly 0 to the end
    precision_answer(f).value       # 1.0: fp32 would do the same
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..numfmt import fmt
from ..runfile.schema import Kind
from . import curve
from .facts import Facts
from .thresholds import UNCHANGED_HIGH
from .verdict import Evidence

# Dead units: on every sampled step from the first dead one to the end, >= 90 % of the trained
# parameters' gradient elements are exactly 0. A healthy ReLU network has far fewer even at
# batch size 1 (a weight's gradient is 0 where either unit it joins is off: ~75 % for units
# off half the time), and a dead one has ~100 % (the Lightning run of
# ``fixtures/lightning/issue15.py`` at LR 3.0: 99.98 %).
DEAD_SHARE = 0.9
# ... and the zeros are new: an earlier sample had under half of them, or a module's output is
# exactly 0 everywhere (every unit of a layer off for the whole batch). Either tells a death
# from zeros that are structural and there all along (embedding rows the batch did not use,
# experts no token was routed to, a branch the loss does not reach).
ALIVE_SHARE = 0.5
# Without a layer seen dead, the new zeros must also fill whole tensors: parameters whose
# gradient is >= 99 % zeros hold at least half the elements. Everything upstream of a dead
# layer is silent as a whole; pruning masks (90 % sparsity set mid-run, the loss flat in the
# fine-tune that follows) leave zeros scattered in every tensor and are not dead units.
SILENT_TENSOR = 0.99
SILENT_SHARE = 0.5


# ---------------------------------------------------------------------------------------------
# What the sampled tier says: dead units


@dataclass
class Dead:
    """Most of the model getting exactly zero gradient up to the end of the run."""

    share: float  # zero share of the gradient elements at the last sampled step
    steps: list[int]  # sampled steps of the dead streak, up to the end
    alive_step: Optional[int] = None  # the last sample before the streak with fewer zeros
    alive_share: float = math.nan
    fresh: bool = False  # some earlier sample had under ALIVE_SHARE of its gradient zero
    layers: list[str] = field(default_factory=list)  # outputs exactly 0 over the streak
    layer_alive: dict = field(default_factory=dict)  # layer -> last step it was not 0
    silent: list[str] = field(default_factory=list)  # parameters with no gradient at all
    learning: list[str] = field(default_factory=list)  # parameters still getting one
    silent_share: float = 0.0  # elements in parameters with >= SILENT_TENSOR zeros

    @property
    def first_step(self) -> int:
        return self.steps[0]

    @property
    def last_alive(self) -> Optional[int]:
        """The last sampled step that shows the network alive: its gradient share, else (when
        no gradient was sampled before the streak) a dead layer's last non-zero output."""
        if self.alive_step is not None:
            return self.alive_step
        known = [s for s in self.layer_alive.values() if s is not None and s < self.first_step]
        return max(known) if known else None


def dead_units(f: Facts) -> Optional[Dead]:
    """The dead streak at the end of the run, when the zeros are new (see ALIVE_SHARE)."""
    return f.memo("dead_units", lambda: _find_dead(f))


def _find_dead(f: Facts) -> Optional[Dead]:
    st = f.reduced
    share = st.grad_zero_share
    idx = np.flatnonzero(np.isfinite(share))
    if not len(idx):
        return None
    dead = share[idx] >= DEAD_SHARE
    k = len(dead) - int(np.flatnonzero(~dead)[-1]) - 1 if (~dead).any() else len(dead)
    if not k:
        return None
    streak = idx[len(idx) - k:]
    steps = [f.step_at(int(i)) for i in streak]
    if steps[-1] == f.step_at(0):
        return None  # only the very first step: zero-initialised layers are not dead yet
    out = Dead(share=float(share[streak[-1]]), steps=steps)
    if k < len(idx):
        out.alive_step = f.step_at(int(idx[-k - 1]))
        out.alive_share = float(share[idx[-k - 1]])
        out.fresh = bool(np.min(share[idx[:-k]]) < ALIVE_SHARE)
    _dead_layers(f, out)
    _silent_params(f, out)
    if not out.layers and not (out.fresh and out.silent_share >= SILENT_SHARE):
        return None  # zeros there all along, or scattered (a pruning mask), not dead units
    if f.curve.judged and not f.curve.flat:
        return None  # the loss still halved: whatever the zeros are, the model learns
    return out


def _dead_layers(f: Facts, out: Dead) -> None:
    """Modules whose output is exactly 0 at the last sample (and on every sample since they
    last had a non-zero value), in execution order: tensor ids are handed out as the first
    forward meets the modules."""
    st, kinds, names = f.reduced, f.tensor_kinds, f.tensor_names
    zero = np.flatnonzero((kinds == Kind.OUTPUT) & st.out_zero_last
                          & (st.out_seen_step >= out.steps[-1]))
    for t in zero:
        out.layers.append(names[t])
        out.layer_alive[names[t]] = int(st.out_alive_step[t]) if st.out_alive_step[t] >= 0 \
            else None


def _silent_params(f: Facts, out: Dead) -> None:
    st, kinds, names = f.reduced, f.tensor_kinds, f.tensor_names
    numel = f.tensor_numel
    grads = np.flatnonzero((kinds == Kind.PARAM_GRAD) & np.isfinite(st.grad_zero_last))
    order = grads[np.argsort(-numel[grads], kind="stable")]
    out.silent = [names[t] for t in order if st.grad_zero_last[t] >= 1.0]
    out.learning = [names[t] for t in order if st.grad_zero_last[t] < 1.0]
    total = float(numel[grads].sum())
    if total:
        out.silent_share = float(numel[grads][st.grad_zero_last[grads] >= SILENT_TENSOR].sum()
                                 / total)


# ---------------------------------------------------------------------------------------------
# Would fp32 have done the same?


def precision_answer(f: Facts, dead: Optional[Dead] = None) -> Evidence:
    """Evidence "fp32_same": value 1.0 when nothing points at the precision (fp32 would fail
    the same way), None when something does and it cannot be told."""
    low = f.low_precision
    if low is None:
        return Evidence("precision plays no part: the run computes in fp32 (no autocast, fp32 "
                        "weights)", "fp32_same", 1.0)
    why, doubt = _precision_facts(f, low, dead)
    if doubt:
        return Evidence(f"whether fp32 would do the same cannot be told: {'; '.join(doubt)}",
                        "fp32_same", None)
    return Evidence("fp32 would do the same, so this is not a precision problem: "
                    + "; ".join(why), "fp32_same", 1.0)


def _precision_facts(f: Facts, low: str, dead: Optional[Dead]) -> tuple[list, list]:
    st, why, doubt = f.reduced, [], []
    low_params = f.params_mostly("bfloat16") or f.params_mostly("float16")
    lay = st.layer_unchanged
    measured = np.isfinite(lay) & (f.tensor_kinds == Kind.PARAM)
    if low_params and measured.any() and np.max(lay[measured]) >= UNCHANGED_HIGH:
        doubt.append(f"the {low} weights lose some updates to rounding (up to "
                     f"{np.max(lay[measured]):.0%} of a tensor's sampled elements unchanged)")
    elif measured.any() and dead is None and np.median(lay[measured]) < UNCHANGED_HIGH:
        # (with no gradient, nothing was there to apply; most weights unchanged in fp32 weights
        # is a step that moved nothing, at an LR of 0 in warm-up: it says nothing of rounding)
        why.append(f"every update was applied ({np.median(lay[measured]):.0%} of the sampled "
                   "weights left unchanged by a step)")
    if not low_params:
        why.append(f"the weights and optimizer state are fp32; {low} only runs the matmuls")
    if dead is not None and dead.layers:
        why.append(f"{dead.layers[0]}'s output is exactly 0: the values entering its units are "
                   "negative, and negative in fp32 too")
    biggest = float(np.nanmax(st.out_absmax)) if np.isfinite(st.out_absmax).any() else None
    if low == "fp16" and np.any(st.out_near > 0):
        doubt.append("activations reached 2**15, within 2x of fp16's 65504")
    elif biggest is not None:
        limit = "fp16's 65504" if low == "fp16" else "bf16's 3.4e38 (fp32's range)"
        why.append(f"the largest activation sampled, {fmt(biggest)}, is far inside {limit}")
    if f.has_scaler and not f.story.benign:
        doubt.append("GradScaler skipped steps beyond its calibration")
    else:
        why.append("no inf/NaN anywhere" + ("" if not f.has_scaler else
                                             " and no step skipped beyond calibration"))
    if dead is not None and not dead.layers and low == "fp16" and (
            not f.has_scaler or f.story.min_scale <= 8):
        doubt.append("fp16 gradients without a working loss scale flush to zero too")
    return why, doubt


def untroubled(f: Facts) -> bool:
    """No non-finite value and no unexplained skip: the other rules have nothing to say."""
    return bool(f.n) and f.failure_index is None and not f.loss_bad.any()


def flat_warning(f: Facts) -> Optional[Evidence]:
    """For a run no rule called a failure: evidence "loss_flat" when a spike came and the run
    never got below half its start. (A loss that did not fall at all, over SHORT_RUN steps
    or more, is ``learning.rule_not_learning``'s verdict, not a warning.)"""
    c = f.curve
    if not c.judged or f.failure_index is not None or not (c.spikes and c.flat):
        return None
    s = c.spikes[0]
    seen = f.reduced.sampled[s.index:].any()
    return Evidence(f"it jumped {s.jump:.0f}x at step {f.step_at(s.index)} and ended at "
                    f"{fmt(c.end)}, {c.end / c.start:.0%} of where it began "
                    f"({fmt(c.start)})" + ("" if seen else "; no sampled step came after "
                                           "the jump, so dead units could not be checked"),
                    "loss_flat", c.end / c.start, f.step_at(s.index))


def recovered_spike(f: Facts) -> Optional[Evidence]:
    """For a run no rule called a failure: evidence "loss_spike_recovered" when the loss jumped
    RECOVERED x or more (``curve.Curve.recovered``) and came back."""
    c = f.curve
    s = c.recovered
    if s is None or f.failure_index is not None:
        return None
    onset, step = f.step_at(s.onset), f.step_at(s.index)
    began = f" (rising from step {onset})" if onset != step else ""
    return Evidence(f"the loss jumped to {fmt(s.value)} at step {step}{began}, {s.jump:.0f}x the "
                    f"{fmt(s.before)} before it, and came back: it ended at {fmt(c.end)}",
                    "loss_spike_recovered", s.jump, onset)


def loss_evidence(f: Facts, c: curve.Curve) -> Evidence:
    """Evidence "loss_not_falling": where the loss began and ended, against its own noise."""
    noise = math.exp(c.noise) - 1.0
    needed = max(1.0 - curve.FLAT_END, 1.0 - math.exp(-curve.FALL_SIGMAS * c.fall_se))
    steady = 1.0 - math.exp(-max(curve.STEADY_NOISE * c.noise,
                                 -math.log(1.0 - curve.STEADY_MIN)))
    return Evidence(f"the loss began at {fmt(c.start)} (median of the first {c.start_steps} "
                    f"steps) and ended at {fmt(c.end)} (median of the last {c.tail_steps} of "
                    f"{c.n}), {c.end / c.start:.0%} of its start; with this run's step-to-step "
                    f"noise (~{noise:.1%}) a fall of {needed:.0%} or more would have shown, or "
                    f"a steady one (third after third) of {steady:.1%}",
                    "loss_not_falling", c.end / c.start, f.step_at(f.n - 1))
