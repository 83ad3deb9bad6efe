"""Which layers to keep in bf16, end to end (issue 36 item 2): ``fixtures/fp8/outlier_growing.py``
(one hidden channel growing to 1000x the others over the run) recorded plain, then with
``record --apply fp8=tensorwise`` (every Linear in fp8) and ``--apply fp8=from:base.h5`` (the
recipe and the layers the plain run's fp8 trial measured), each compared with the plain run."""

from __future__ import annotations

import os
import subprocess

import pytest
from testenv import PYTHON, ROOT, python_env

import ampdoctor

SCRIPT = os.path.join(ROOT, "fixtures", "fp8", "outlier_growing.py")


def record(out, *apply):
    cmd = [PYTHON, "-m", "ampdoctor", "record", "-o", out, "--every", "10", "--force", "-q",
           *(a for x in apply for a in ("--apply", x)), "--", PYTHON, SCRIPT]
    proc = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(out))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_the_trial_keeps_what_the_outlier_reaches_and_keeping_it_tracks_the_baseline(tmp_path):
    pytest.importorskip("torchao")
    base, every, kept = (str(tmp_path / n) for n in ("base.h5", "all.h5", "kept.h5"))
    record(base)
    r = ampdoctor.fp8_readiness(base)
    tw = r.recipes["tensorwise"]
    assert tw.decided_by == "trial" and r.trial["step"] == 50 and r.trial["weights_step"] == 59
    # the layers the outlier channel reaches, measured; the first Linear, before it, is not
    assert set(tw.keep_high_precision) == {"fc2", "head"}
    assert "fc1" not in tw.keep_high_precision
    # the statistics alone flag no layer under tensorwise: 1000x still fits e4m3's range
    assert all(layer.status == "ok" for layer in tw.layers.values())
    record(every, "fp8=tensorwise")
    record(kept, "fp8=from:base.h5")
    applied = ampdoctor.load(kept).meta["applied"][0]
    assert applied["arg"] == "fp8=tensorwise:keep=head,fc2"
    assert sorted(applied["kept"]) == ["fc2", "head"] and applied["converted"] == ["fc1"]
    all_fp8, with_keep = ampdoctor.compare(base, every), ampdoctor.compare(base, kept)
    assert all_fp8.verdict == "diverged", all_fp8.summary
    assert with_keep.verdict == "drift", with_keep.summary
    assert abs(with_keep.final_rel) < abs(all_fp8.final_rel)
