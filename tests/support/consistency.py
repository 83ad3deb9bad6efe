"""Does a diagnosis contradict its own measurements? (issue 28: every sentence from a fact)

``contradictions(d, run)`` reads the sentences a diagnosis prints that state a measurement
(counts of steps and losses, a claim that a fix works, that the weights were steady) and checks
each against the run file and the diagnosis's own trials and premises; it returns what does
not hold, one line each. The fixture tests call it on every recorded fixture.
"""

from __future__ import annotations

import re

import numpy as np


def contradictions(d, run) -> list[str]:
    found: list[str] = []
    texts = [d.summary] + [e.text for e in d.evidence] + list(d.notes)
    steps = run.steps
    n = len(steps)
    skipped = int(np.sum(steps["skipped"] != 0)) if n else 0
    finite = int(np.sum(np.isfinite(steps["loss"]))) if n else 0
    for text in texts:
        flat = " ".join(text.split())
        for a, b in re.findall(r"(\d+) of (\d+) steps were skipped", flat):
            if (int(a), int(b)) != (skipped, n):
                found.append(f"says {a} of {b} steps were skipped; the file has {skipped} of {n}:"
                             f" {flat[:160]}")
        for a, b in re.findall(r"(\d+) of (\d+) losses finite", flat):
            if (int(a), int(b)) != (finite, n):
                found.append(f"says {a} of {b} losses finite; the file has {finite} of {n}")
        if re.search(r"\bno step was skipped\b", flat) and skipped:
            found.append(f"says no step was skipped; {skipped} were: {flat[:160]}")
    island = next((fx for fx in d.fixes if fx.id == "fp32_island"), None)
    if "island around it fixes the step" in d.summary and not (island and island.proven):
        found.append("the summary says the island fixes the step; its trial does not say so")
    if "while the weights are steady" in d.summary:
        steady = [p for p in getattr(d, "premises", []) if getattr(p, "name", None) ==
                  "weights_steady" or (isinstance(p, dict) and p.get("name") == "weights_steady")]
        status = [p.status if hasattr(p, "status") else p.get("status") for p in steady]
        if status != ["held"]:
            found.append(f"the summary says the weights are steady; its premise is {status}")
    for fx in d.fixes:
        if not fx.tried:
            continue
        if "is finite" in fx.outcome and not fx.finite:
            found.append(f"{fx.id}'s outcome says finite; the trial was not: {fx.outcome}")
        if "not enough" in fx.outcome and fx.finite and fx.proven is not False:
            found.append(f"{fx.id}'s outcome says not enough; the trial was fine: {fx.outcome}")
    return found
