"""Each verdict's premises, checked against the file (issue 28): what must hold for it, held,
failed (the verdict is removed and ``rejected`` says why) or not measured; on runs built in
memory (``synthetic.py``)."""

import json

import numpy as np
from synthetic import Synth

from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.runfile.schema import Kind


def verdict(s: Synth):
    return diagnose(s.run())


def premises(d, verdict_id=None):
    """The premises of the verdict (or of a rejected one), by name, from the JSON."""
    data = json.loads(json.dumps(d.to_dict()))
    if verdict_id is None or verdict_id == data["verdict"]:
        return {p["name"]: p for p in data["premises"]}
    found = [r for r in data["rejected"] if r["verdict"] == verdict_id]
    assert found, f"{verdict_id} neither the verdict nor rejected: {data['verdict']}"
    return {p["name"]: p for p in found[0]["premises"]}


# -- state_poisoning: a buffer that was finite and became non-finite ---------------------------


def _mask(s: Synth, steps, **fields):
    """A causal mask kept as a buffer, filled with -inf above the diagonal: the same at every
    sample."""
    row = dict(nonfinite=4, neginf=2016, zeros=2080, absmax=np.inf, rms=0.0)
    row.update(fields)
    for step in steps:
        s.stat(step, Kind.BUFFER, "transformer.attn_mask", **{k: (v(step) if callable(v) else v)
                                                              for k, v in row.items()})
        s.stat(step, Kind.PARAM, "transformer.0.weight", norm=3.0, update=1e-3)


def test_a_constant_buffer_of_minus_inf_in_a_healthy_run_is_not_state_poisoning():
    s = Synth(40)
    _mask(s, (0, 10, 20, 30))
    d = verdict(s)
    assert d.verdict == "healthy"
    p = premises(d, "state_poisoning")["buffer_was_finite"]
    assert p["status"] == "failed" and "transformer.attn_mask" in p["fact"]
    assert "step 0" in p["fact"] and "never changed" in p["fact"]
    assert any(n.startswith("Not state_poisoning:") for n in d.notes)


def test_a_constant_mask_buffer_hides_no_real_failure():
    s = Synth(40, scaler=False, dtype="bfloat16")
    s.nan_loss(range(20, 40))
    s.snapshot(20, "forward", "transformer.0", "Linear", fp32_finite=1)
    _mask(s, (0, 10, 20, 30))
    d = verdict(s)
    assert d.verdict not in ("state_poisoning", "healthy")
    assert [r["verdict"] for r in d.rejected] == ["state_poisoning"]


def test_a_running_statistic_seen_finite_then_poisoned_holds_its_premise():
    s = Synth(40)
    s.skip([12], loss_nan=True)
    s.snapshot(12, "input", "BNNet", "BNNet")
    for step in (10, 20, 30):
        s.stat(step, Kind.BUFFER, "features.1.running_var", nonfinite=1 if step > 12 else 0)
        s.stat(step, Kind.PARAM, "features.0.weight", norm=3.0, update=1e-3)
    d = verdict(s)
    assert d.verdict == "state_poisoning"
    p = premises(d)["buffer_was_finite"]
    assert p["status"] == "held" and "finite at step 10" in p["fact"]
    assert d.rejected == []


def test_a_buffer_non_finite_from_its_first_sample_that_changes_is_a_statistic():
    s = Synth(40)
    _mask(s, (0, 10, 20, 30), nonfinite=1, nan=1, absmax=np.nan, rms=lambda step: 1.0 + step)
    d = verdict(s)
    assert d.verdict == "state_poisoning"
    assert premises(d)["buffer_was_finite"]["status"] == "held"


def test_a_poisoned_statistic_beside_a_constant_mask_is_still_found():
    s = Synth(40)
    s.skip([12], loss_nan=True)
    _mask(s, (0, 10, 20, 30))
    for step in (10, 20, 30):
        s.stat(step, Kind.BUFFER, "features.1.running_var", nonfinite=1 if step > 12 else 0)
    d = verdict(s)
    assert d.verdict == "state_poisoning" and d.first_bad["module"] == "features.1"
    assert "attn_mask" not in " ".join(e.text for e in d.evidence)


def test_a_buffer_first_sampled_after_the_failure_is_not_measured():
    s = Synth(40, every=100)
    s.skip([12], loss_nan=True)
    for step in (20, 30):
        s.stat(step, Kind.BUFFER, "features.1.running_var", nonfinite=1)
    d = verdict(s)
    assert d.verdict == "state_poisoning"
    assert premises(d)["buffer_was_finite"]["status"] == "not measured"
    assert d.confidence < 0.85
