"""The fallback rules (``diagnosis/rules/fallbacks.py``) on runs built in memory (no torch):
weights non-finite before the run's first update (a resume from a NaN checkpoint), told as
such, with the checkpoint to reload and no op, LR or precision fix."""

from synthetic import Synth

from ampdoctor.diagnosis.engine import diagnose


def _resumed(n=40, applied_before=0, at=None):
    """A run whose replay at step ``at`` (default: the first skipped one) finds ``head.weight``
    non-finite; ``applied_before`` steps were applied before it."""
    s = Synth(n)
    s.skip(range(applied_before, n), loss_nan=True)
    step = applied_before if at is None else at
    s.snapshot(step, "forward", "head", "Linear", fp32_finite=0,
               weights_nonfinite=["weight"])
    return s


def test_weights_nonfinite_before_the_first_update_are_the_checkpoints():
    """blind6 resume_nan_checkpoint: it was scale_collapse 0.4 with use_bf16."""
    d = diagnose(_resumed().run())
    assert d.verdict == "nonfinite" and d.causes[0]["kind"] == "loaded_nonfinite", str(d)
    assert d.confidence >= 0.9 and d.first_bad == {"step": 0, "module": "head",
                                                   "phase": "forward"}
    assert [fx.id for fx in d.fixes] == ["reload_finite_checkpoint"]
    assert "head.weight already NaN/inf at the run's first step" in d.evidence[0].text
    assert "in fp32 too" in d.summary


def test_every_earlier_step_skipped_still_counts_as_before_the_first_update():
    d = diagnose(_resumed(at=6).run())
    assert d.causes[0]["kind"] == "loaded_nonfinite"
    assert "every step before it skipped" in d.evidence[0].text


def test_weights_an_applied_step_made_nonfinite_are_not_loaded_so():
    d = diagnose(_resumed(applied_before=10).run())
    assert d.causes[0].get("kind") != "loaded_nonfinite"
    assert "reload_finite_checkpoint" not in [fx.id for fx in d.fixes]
