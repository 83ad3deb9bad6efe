"""What the forensic replays and the sampled tier say of the batch, for ``bad_input``
(``located.rule_bad_input``, taxonomy C5): a batch that held NaN/inf, values beyond fp16's
range, or values thousands of times those of the batches before the failure (off-scale: a
shard left unnormalised); and where the run of bad steps a batch belongs to began.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..numfmt import fmt
from ..runfile.payloads import SnapshotDetail
from .culprit import input_out_of_range
from .facts import Facts
from .verdict import Evidence, first_bad


def from_replays(f: Facts) -> tuple[Optional[dict], float, list[Evidence],
                                            Optional[dict]]:
    """Replays that found the batch non-finite, or an fp16 culprit fed a batch beyond range;
    with what check_data may say of it."""
    inputs = [s for s in f.snapshots if s["phase"] == "input"]
    if inputs:
        s = inputs[0]
        replay = SnapshotDetail.from_json(s["detail"]).replay or ""
        how = "batch check; no replay under FSDP" if replay.startswith("off") else \
            "forensic replay"
        ev = [Evidence(f"the batch given to {s['module'] or 'the model'} at step {s['step']} "
                       f"held NaN/inf ({how})", "input_nonfinite_step", None,
                       s["step"], s["module"])]
        if len(inputs) > 1:
            ev.append(Evidence(f"{len(inputs)} replayed steps had non-finite inputs (steps "
                               f"{', '.join(str(x['step']) for x in inputs[:8])})",
                               "input_nonfinite_replays", float(len(inputs))))
        labels = [b.label for b in SnapshotDetail.from_json(s["detail"]).bad_inputs if b.label]
        data = {"kind": "nonfinite", "step": s["step"], "labels": labels}
        return first_bad(s["step"], s["module"], "input"), 0.95, ev, data
    for s in f.snapshots:
        biggest = input_out_of_range(f, s)
        if biggest is not None:
            ev = [Evidence(f"the batch at step {s['step']} holds values up to {fmt(biggest)}, "
                           f"beyond fp16's 65504; {s['module']} overflows on them",
                           "input_absmax", biggest, s["step"], s["module"])]
            data = {"kind": "range", "step": s["step"], "absmax": biggest}
            return first_bad(s["step"], s["module"], "input"), 0.85, ev, data
    return None, 0.0, [], None


def from_samples(f: Facts, known: bool) -> tuple[Optional[dict], float,
                                                         list[Evidence], Optional[dict]]:
    """The sampled tier's audit of the batch: non-finite, or beyond fp16's range (the latter
    only counts beside a failure: a large input that fp32 layers take in stride is fine)."""
    st, where, conf, ev, data = f.reduced, None, 0.0, [], None
    bad_steps = np.flatnonzero(st.input_bad > 0)
    if len(bad_steps):
        i = int(bad_steps[0])
        ev.append(Evidence(f"sampled step {f.step_at(i)}: the model's input held NaN/inf",
                           "sampled_input_nonfinite", None, f.step_at(i)))
        where, conf = first_bad(f.step_at(i), None, "input"), 0.8
        data = {"kind": "nonfinite", "step": f.step_at(i)}
    over = np.flatnonzero(st.input_over > 0) if f.low_precision == "fp16" else np.zeros(0, int)
    if len(over) and (known or where is not None or f.failure_index is not None):
        i = int(over[0])
        ev.append(Evidence(f"sampled step {f.step_at(i)}: input values up to "
                           f"{fmt(float(st.input_absmax[i]))}, beyond fp16's 65504",
                           "sampled_input_absmax", float(st.input_absmax[i]), f.step_at(i)))
        if where is None:
            where, conf = first_bad(f.step_at(i), None, "input"), 0.7
            data = {"kind": "range", "step": f.step_at(i),
                    "absmax": float(st.input_absmax[i])}
    return where, conf, ev, data


# A batch this many times larger than those of the steps before the failure is off-scale
# (raw 16-bit readings where the rest were scaled, a shard left unnormalised).
OFF_SCALE = 1024.0


def off_scale(f: Facts) -> tuple[Optional[dict], float, list[Evidence],
                                         Optional[dict]]:
    """The first batch from the failure on (the replay's saved one, else a sampled step's) is
    OFF_SCALE times or more the largest input of the sampled steps before the failure: finite
    and inside fp16's range, but off-scale, and the model overflowed on it."""
    i, a = f.failure_index, f.reduced.input_absmax
    before = a[:i][np.isfinite(a[:i]) & (a[:i] > 0)] if i is not None else a[:0]
    if i is None or not len(before):
        return None, 0.0, [], None
    typical = float(np.median(before))
    found = [(s["step"], f.batch_absmax(s["id"])[0]) for s in f.snapshots
             if s["step"] >= f.failure_step][:1]
    found += [(f.step_at(j), float(a[j])) for j in range(i, len(a)) if np.isfinite(a[j])][:1]
    step, big = next(((t, m) for t, m in found if m >= OFF_SCALE * typical), (None, 0.0))
    if step is None:
        return None, 0.0, [], None
    ev = [Evidence(f"the batch at step {step} holds values up to {fmt(big)}, {big / typical:.0f}x "
                   f"the {fmt(typical)} of the batches on the sampled steps before the failure: "
                   "finite and inside fp16's range, but off-scale", "input_off_scale",
                   big / typical, step)]
    data = {"kind": "off_scale", "step": step, "absmax": big, "typical": typical,
            "ratio": big / typical}
    return first_bad(step, None, "input"), 0.8, ev, data


def run_start(f: Facts, step: int) -> int:
    """The first step of the unbroken run of failing steps that ``step`` belongs to (the
    first steps of a run are not replayed while the recorder discovers the model)."""
    i = f.index_of(step)
    bad = f.loss_bad | f.skipped
    while i > 0 and bad[i - 1] and bad[i]:
        i -= 1
    return f.step_at(i)
