"""The blind score: ampdoctor's verdicts on ``fixtures/blind/``, scripts written from real bug
threads before anyone tuned the diagnosis to them.

Each entry of ``fixtures/blind/expected.json`` (a script, with ``--fix`` for a failure's
textbook fix) is recorded with ``python -m ampdoctor record -o OUT.h5 --force -- python
SCRIPT [args]`` and diagnosed with ``python -m ampdoctor diagnose OUT.h5 --format json``; the
verdict is right when it is one the expert accepts (``accept``). The score: failures named
right x/N, healthy runs (healthy scripts and ``--fix`` runs) with no false alarm x/M, and
calibration: of the verdicts given with confidence >= 0.9, how many were right.

    python benchmarks/blind_score.py --out benchmarks/results/blind_before.json
    python benchmarks/blind_score.py --only norm_overflow            # one script (and its --fix)
    python benchmarks/blind_score.py --only "norm_overflow --fix"    # one entry
    python benchmarks/blind_score.py --jobs 2 --workdir /tmp/blind   # two at a time, keep runs
    python benchmarks/blind_score.py --show benchmarks/results/blind_before.json  # a saved table
    python benchmarks/blind_score.py --corpus fixtures/blind2 --root /path/to/other/checkout

Eleven corpora, each written by an engineer who had not read ``ampdoctor/diagnosis/``:
``fixtures/blind`` (the default) to ``fixtures/blind11``; each one's theme is in the
``_about`` of its ``expected.json``.

Run from the repository root so that its ``ampdoctor`` is the one imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fixtures", "blind")
CONFIDENT = 0.9


def load_expected(path: str) -> dict[str, dict[str, Any]]:
    """The corpus's entries by name (``_about`` and other notes left out)."""
    with open(path) as f:
        data = json.load(f)
    return {name: entry for name, entry in data.items() if not name.startswith("_")}


def selected(entries: dict[str, dict[str, Any]], only: Optional[str]) -> list[str]:
    """The entries ``--only`` names: an entry's full name, or a script with its ``--fix``."""
    if only is None:
        return list(entries)
    names = [n for n in entries if n == only or n.split(" ")[0] == only]
    if not names:
        sys.exit(f"blind_score: no entry named {only!r} in the corpus")
    return names


def env(root: str) -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = root + os.pathsep + out.get("PYTHONPATH", "")
    return out


def score_one(name: str, entry: dict[str, Any], workdir: str, timeout: float,
              corpus: str = CORPUS, root: str = ROOT) -> dict[str, Any]:
    """Records and diagnoses one entry with the ampdoctor of checkout ``root``; the row of
    the table."""
    script = os.path.join(corpus, name.split(" ")[0] + ".py")
    run = os.path.join(workdir, name.replace(" --", "__").replace(" ", "_") + ".h5")
    row: dict[str, Any] = {"name": name, "kind": entry["kind"], "expected": entry["verdict"],
                           "accept": entry["accept"], "got": None, "confidence": None,
                           "first_bad": None, "right": False, "error": None}
    started = time.monotonic()
    record = [sys.executable, "-m", "ampdoctor", "record", "-o", run, "--force", "--",
              sys.executable, script, *entry["args"]]
    try:
        done = subprocess.run(record, cwd=root, env=env(root), capture_output=True, text=True,
                              timeout=timeout)
        diag = subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", run,
                               "--format", "json"], cwd=root, env=env(root),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        row["error"] = [f"timed out after {exc.timeout:.0f} s"]
        return row
    row["record_rc"] = done.returncode
    row["seconds"] = round(time.monotonic() - started, 1)
    if diag.returncode != 0:
        row["error"] = (diag.stderr or diag.stdout).strip().splitlines()[-1:]
        return row
    result = json.loads(diag.stdout)
    row["got"] = result["verdict"]
    row["confidence"] = result["confidence"]
    row["first_bad"] = result.get("first_bad")
    row["right"] = result["verdict"] in entry["accept"]
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Failures right, healthy runs without a false alarm, calibration at >= 0.9."""
    failures = [r for r in rows if r["kind"] == "failure"]
    healthy = [r for r in rows if r["kind"] != "failure"]
    confident = [r for r in rows if (r["confidence"] or 0) >= CONFIDENT]
    return {
        "failures_right": sum(r["right"] for r in failures), "failures": len(failures),
        "healthy_right": sum(r["right"] for r in healthy), "healthy": len(healthy),
        "confident_right": sum(r["right"] for r in confident), "confident": len(confident),
    }


def table(rows: list[dict[str, Any]], score: dict[str, Any]) -> str:
    lines = [f"{'script':34} {'expected':14} {'got':18} {'conf':>5}  {'first bad':24} result"]
    for r in rows:
        conf = "" if r["confidence"] is None else f"{r['confidence']:.2f}"
        fb = r["first_bad"] or {}
        where = "" if not fb else f"{fb.get('step')} {fb.get('module') or ''} {fb.get('phase') or ''}"
        got = r["got"] or "error (below)"
        lines.append(f"{r['name']:34} {r['expected']:14} {got:18} {conf:>5}  {where[:24]:24} "
                     f"{'right' if r['right'] else 'WRONG'}")
    for r in rows:
        if r["error"]:
            lines.append(f"{r['name']}: {' '.join(r['error'])[:300]}")
    lines.append("")
    lines.append(f"failures right: {score['failures_right']}/{score['failures']}")
    lines.append(f"healthy with no false alarm: {score['healthy_right']}/{score['healthy']}")
    lines.append(f"calibration: of {score['confident']} verdicts at confidence >= {CONFIDENT}, "
                 f"{score['confident_right']} right")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one entry, or a script name with its --fix entry")
    parser.add_argument("--jobs", type=int, default=1, help="entries recorded at once (1)")
    parser.add_argument("--out", help="write the table and the score to this JSON file")
    parser.add_argument("--workdir", help="keep the run files here (default: a temp folder)")
    parser.add_argument("--corpus", default=CORPUS,
                        help="the folder of scripts and its expected.json (fixtures/blind, "
                             "fixtures/blind2)")
    parser.add_argument("--root", default=ROOT,
                        help="the checkout whose ampdoctor is scored (default: this one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command")
    parser.add_argument("--show", help="print the table of a result file written by --out")
    args = parser.parse_args(argv)
    if args.show:
        with open(args.show) as f:
            saved = json.load(f)
        print(table(saved["rows"], saved["score"]))
        return 0
    corpus, root = os.path.abspath(args.corpus), os.path.abspath(args.root)
    entries = load_expected(os.path.join(corpus, "expected.json"))
    names = selected(entries, args.only)
    workdir = args.workdir or tempfile.mkdtemp(prefix="blind_")
    os.makedirs(workdir, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda n: score_one(n, entries[n], workdir, args.timeout, corpus,
                                                 root), names))
    score = summary(rows)
    print(table(rows, score))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "score": score}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
