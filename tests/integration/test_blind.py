"""The blind corpus (``fixtures/blind/``) reproduces what it claims, with no ampdoctor in the
run: each failure script fails the way its docstring and its thread say, each healthy script
and each failure's ``--fix`` trains (its loss falls, or sits at its floor).

What ampdoctor says about these scripts is the benchmark's business
(``benchmarks/blind_score.py``), not this test's: the corpus is a blind test of the diagnosis,
so nothing here asserts a verdict.
"""

import json
import math
import os
import re
import subprocess

import pytest
from conftest import PYTHON, ROOT, python_env

CORPUS = os.path.join(ROOT, "fixtures", "blind")
ENTRIES = {k: v for k, v in json.load(open(os.path.join(CORPUS, "expected.json"))).items()
           if not k.startswith("_")}
STEP = re.compile(r"^step (\d+) loss (\S+)(.*)$")


def run(name: str) -> list[tuple[int, float, str]]:
    """Runs an entry with plain python; (step, loss, the rest of the line) for each step."""
    entry = ENTRIES[name]
    script = os.path.join(CORPUS, name.split(" ")[0] + ".py")
    done = subprocess.run([PYTHON, script, *entry["args"]], cwd=ROOT, env=python_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = []
    for line in done.stdout.splitlines():
        match = STEP.match(line)
        if match:
            steps.append((int(match[1]), float(match[2]), match[3]))
    assert steps, f"{name} printed no step"
    return steps


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def ends(losses: list[float]) -> tuple[float, float]:
    """The mean loss of the first and of the last quarter (at most 10 steps each)."""
    k = max(1, min(10, len(losses) // 4))
    return mean(losses[:k]), mean(losses[-k:])


def field(rest: str, key: str) -> float:
    return float(re.search(rf"\b{key} (\S+)", rest)[1])


def check_zero_inf_where(steps):
    # the forward is finite; the gradients are NaN on every step (0 * inf in sqrt's backward)
    assert all(math.isfinite(loss) for _, loss, _ in steps)
    assert all(field(rest, "grad_finite") == 0 for _, _, rest in steps)


def check_var_cancellation(steps):
    # NaN from the first step (rsqrt of a negative variance); the inputs are finite and small
    assert math.isnan(steps[0][1])


def check_all_masked_softmax(steps):
    # finite until the first batch with an empty sequence (step 7), NaN from then on
    assert all(math.isfinite(loss) for s, loss, _ in steps if s < 7)
    assert all(math.isnan(loss) for s, loss, _ in steps if s >= 7)


def check_lr_warmup_blowup(steps):
    # the loss climbs with the warm-up, then goes non-finite; the scale collapses below 1
    losses = [loss for _, loss, _ in steps]
    first_bad = next(i for i, loss in enumerate(losses) if not math.isfinite(loss))
    assert first_bad > 3
    assert max(losses[:first_bad]) > 10 * losses[0]
    assert field(steps[-1][2], "scale") < 1


def check_attn_logit_overflow(steps):
    # NaN from the first step (the fp16 logits pass 65504)
    assert math.isnan(steps[0][1])
    assert field(steps[-1][2], "scale") < 1


def check_norm_overflow(steps):
    # no NaN, but the loss does not fall: the norm outputs zeros
    losses = [loss for _, loss, _ in steps]
    assert all(math.isfinite(loss) for loss in losses)
    first, last = ends(losses)
    assert last > 0.95 * first
    assert abs(last - math.log(4)) < 0.1  # chance for 4 balanced classes


FAILS = {name: globals()[f"check_{name}"] for name, e in ENTRIES.items() if e["kind"] == "failure"}
TRAINS = [name for name, e in ENTRIES.items() if e["kind"] != "failure"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAILS))
def test_failure_reproduces(name):
    FAILS[name](run(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINS))
def test_trains(name):
    losses = [loss for _, loss, _ in run(name)]
    assert all(math.isfinite(loss) for loss in losses)
    first, last = ends(losses)
    if name == "healthy_noise_floor":
        assert last <= first and 0.6 < last < 1.4  # at its floor (noise variance 1)
    else:
        assert last < 0.8 * first


def test_corpus_is_complete():
    # every failure has its --fix entry, and every script in the folder has an entry
    failures = {n for n, e in ENTRIES.items() if e["kind"] == "failure"}
    assert {f"{n} --fix" for n in failures} <= set(ENTRIES)
    scripts = {f[:-3] for f in os.listdir(CORPUS) if f.endswith(".py")}
    assert scripts == {n.split(" ")[0] for n in ENTRIES}
    assert len(failures) >= 6 and len(scripts - failures) >= 12
