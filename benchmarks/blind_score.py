"""Score ``ampdoctor diagnose`` on the blind corpus (``fixtures/blind/``).

Each script there (and each failure's ``--fix`` run) is recorded and diagnosed with the
ampdoctor of a chosen checkout, and its verdict compared with the expert verdict in
``fixtures/blind/expected.json`` (written before the tool was run on them):

    python benchmarks/blind_score.py                          # this checkout's ampdoctor
    python benchmarks/blind_score.py --root /work/main        # another checkout's
    python benchmarks/blind_score.py --only masked_row_nan    # one script (and its --fix)
    python benchmarks/blind_score.py --out benchmarks/results/blind_before.json

It prints one row per run (script, expected, got, confidence, right/wrong) and the totals:
failures given their expert verdict, healthy runs (healthy scripts and --fix runs) with no
false alarm, and how many of the verdicts given at confidence >= 0.9 are right. The scripts
always come from this file's checkout; ``--root`` only chooses the ampdoctor (PYTHONPATH).
No torch needed here (the scripts import it in their own processes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parents[1]
CORPUS = HERE / "fixtures" / "blind"
HIGH_CONFIDENCE = 0.9
RUN_TIMEOUT_S = 300


@dataclass
class Row:
    """One run of the corpus: what the expert expects and what the tool said."""

    case: str
    expected: str
    got: str
    confidence: Optional[float]
    right: bool
    seconds: float
    reason: str


def load_cases(only: Optional[str]) -> dict[str, dict[str, str]]:
    """The cases of expected.json, keyed ``"script.py"`` or ``"script.py --fix"``.

    ``only`` keeps those of one script, named with or without ``.py`` (its --fix run too).
    """
    cases: dict[str, dict[str, str]] = json.loads((CORPUS / "expected.json").read_text())
    if only is None:
        return cases
    name = only if only.endswith(".py") else only + ".py"
    kept = {key: case for key, case in cases.items() if key.split()[0] == name or key == only}
    if not kept:
        raise SystemExit(f"blind_score: no case named {only!r} in {CORPUS / 'expected.json'}")
    return kept


def diagnose_one(case: str, root: Path, workdir: Path) -> tuple[str, Optional[float]]:
    """Record ``case`` with ``root``'s ampdoctor and return (verdict, confidence).

    A record or diagnose that fails gives ``error: ...`` as the verdict (scored wrong).
    """
    script, *flags = case.split()
    out = workdir / (script.removesuffix(".py") + ("_fix" if flags else "") + ".h5")
    env = dict(os.environ, PYTHONPATH=str(root))
    record = [sys.executable, "-m", "ampdoctor", "record", "-o", str(out), "--force", "--"]
    record += [sys.executable, str(CORPUS / script), *flags]
    try:
        subprocess.run(
            record, env=env, cwd=root, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"error: record ran past {RUN_TIMEOUT_S} s", None
    if not out.exists():
        return "error: record wrote no file", None
    diagnose = [sys.executable, "-m", "ampdoctor", "diagnose", str(out), "--format", "json"]
    try:
        done = subprocess.run(
            diagnose, env=env, cwd=root, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"error: diagnose ran past {RUN_TIMEOUT_S} s", None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"error: diagnose exited {done.returncode}: {last}", None
    report = json.loads(done.stdout)
    return str(report["verdict"]), report.get("confidence")


def head_commit(root: Path) -> Optional[str]:
    """The commit checked out at ``root`` (None outside git): a score names what it scored."""
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or None


def totals(rows: list[Row]) -> dict[str, list[int]]:
    """[right, of] for the failures, the healthy runs and the verdicts at high confidence."""
    failures = [row for row in rows if row.expected != "healthy"]
    healthy = [row for row in rows if row.expected == "healthy"]
    confident = [
        row for row in rows if row.confidence is not None and row.confidence >= HIGH_CONFIDENCE
    ]
    return {
        "failures_right": [sum(row.right for row in failures), len(failures)],
        "healthy_no_false_alarm": [sum(row.right for row in healthy), len(healthy)],
        "confident_right": [sum(row.right for row in confident), len(confident)],
    }


def print_table(rows: list[Row], counts: dict[str, list[int]]) -> None:
    """The table of runs and the totals, as plain text."""
    width = max(len(row.case) for row in rows)
    print(f"{'script':<{width}}  {'expected':<14} {'got':<20} {'conf':>5}  result")
    for row in rows:
        conf = "-" if row.confidence is None else f"{row.confidence:.2f}"
        result = "right" if row.right else "WRONG"
        print(f"{row.case:<{width}}  {row.expected:<14} {row.got:<20} {conf:>5}  {result}")
    right, of = counts["failures_right"]
    print(f"failures right: {right}/{of}")
    right, of = counts["healthy_no_false_alarm"]
    print(f"healthy (scripts and --fix runs) with no false alarm: {right}/{of}")
    right, of = counts["confident_right"]
    print(f"verdicts at confidence >= {HIGH_CONFIDENCE}: {right}/{of} right")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one script of the corpus (and its --fix run)")
    parser.add_argument("--out", type=Path, help="write the rows and totals as JSON")
    parser.add_argument(
        "--root", type=Path, default=HERE, help="the checkout whose ampdoctor is used"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "ampdoctor" / "__init__.py").exists():
        print(f"blind_score: {root} holds no ampdoctor package", file=sys.stderr)
        return 2
    commit = head_commit(root)
    rows = []
    with tempfile.TemporaryDirectory(prefix="blind_score_") as tmp:
        for case, expected in load_cases(args.only).items():
            started = time.monotonic()
            got, confidence = diagnose_one(case, root, Path(tmp))
            seconds = round(time.monotonic() - started, 1)
            right = got == expected["verdict"]
            rows.append(
                Row(case, expected["verdict"], got, confidence, right, seconds, expected["reason"])
            )
            print(f"  {case}: {got} ({seconds} s)", file=sys.stderr, flush=True)
    counts = totals(rows)
    print_table(rows, counts)
    if head_commit(root) != commit:
        print(f"blind_score: {root} moved from commit {commit} during the run", file=sys.stderr)
        commit = None
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "root": str(root),
            "commit": commit,
            "rows": [asdict(row) for row in rows],
            "totals": counts,
        }
        args.out.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
